//! A [`Comm`] that forwards to another and records every payload it carries.

use std::cell::RefCell;

use sdp4bit::Result;
use sdp4bit::collective::{Comm, SumElement};

/// One collective call as a [`Recorder`] saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The collective: `all_gather`, `all_to_all`, `all_reduce_max` or `reduce_scatter`.
    pub op: &'static str,
    /// Bytes this rank passed in.
    pub send: Vec<u8>,
    /// Bytes this rank got back.
    pub recv: Vec<u8>,
}

/// A [`Comm`] that forwards to `inner` and records every payload (sent and received bytes).
#[derive(Debug)]
pub struct Recorder<'a, C: Comm> {
    inner: &'a C,
    log: RefCell<Vec<Record>>,
}

impl<'a, C: Comm> Recorder<'a, C> {
    /// A recorder of `inner` with an empty log.
    pub fn new(inner: &'a C) -> Self {
        Self {
            inner,
            log: RefCell::new(Vec::new()),
        }
    }

    /// The records since the last call, oldest first.
    pub fn take(&self) -> Vec<Record> {
        std::mem::take(&mut *self.log.borrow_mut())
    }

    fn push(&self, op: &'static str, send: &[u8], recv: &[u8]) {
        self.log.borrow_mut().push(Record {
            op,
            send: send.to_vec(),
            recv: recv.to_vec(),
        });
    }
}

impl<C: Comm> Comm for Recorder<'_, C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn all_gather(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        self.inner.all_gather(send, recv)?;
        self.push("all_gather", send, recv);
        Ok(())
    }

    fn all_to_all(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        self.inner.all_to_all(send, recv)?;
        self.push("all_to_all", send, recv);
        Ok(())
    }

    fn all_reduce_max(&self, value: f32) -> Result<f32> {
        let out = self.inner.all_reduce_max(value)?;
        self.push("all_reduce_max", &value.to_le_bytes(), &out.to_le_bytes());
        Ok(out)
    }

    fn all_reduce_max_in_place(&self, word: &mut [f32]) -> Result<()> {
        let sent = bytemuck::cast_slice::<f32, u8>(word).to_vec();
        self.inner.all_reduce_max_in_place(word)?;
        self.push("all_reduce_max", &sent, bytemuck::cast_slice(word));
        Ok(())
    }

    fn reduce_scatter_sum<T: SumElement>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.inner.reduce_scatter_sum(send, recv)?;
        self.push(
            "reduce_scatter",
            bytemuck::cast_slice(send),
            bytemuck::cast_slice(recv),
        );
        Ok(())
    }
}
