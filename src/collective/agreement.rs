//! The set-up check that every rank of a DP group planned the same thing.

use crate::collective::Comm;
use crate::config::Config;
use crate::error::{Error, Result};

/// What each rank publishes: its config fingerprint, bucket id and bucket size.
const RECORD: usize = 24;

/// All-gathers (config fingerprint, bucket id, bucket size) over `comm` and fails on every rank,
/// naming the first rank that differs from rank 0, unless all agree. Run it once when a bucket
/// is set up: a mismatch found later would leave ranks waiting in differently-sized
/// collectives, which real backends (NCCL) turn into a hang.
pub fn check_ranks_agree<C: Comm>(
    comm: &C,
    config: &Config,
    bucket_id: u32,
    numel: usize,
) -> Result<()> {
    check_setup_agrees(comm, Ok(config), bucket_id, numel)
}

/// [`check_ranks_agree`] for a set-up that may already have failed on this rank
/// (`Err(reason)`: a bad config or input). The failed rank still takes part in the exchange,
/// so that its peers fail at once, naming it, instead of waiting in the next collective; it
/// returns its own reason.
pub fn check_setup_agrees<C: Comm>(
    comm: &C,
    setup: std::result::Result<&Config, &Error>,
    bucket_id: u32,
    numel: usize,
) -> Result<()> {
    let mut mine = [0u8; RECORD];
    if let Ok(config) = setup {
        mine[..8].copy_from_slice(&config.fingerprint().to_le_bytes());
    }
    mine[8..12].copy_from_slice(&bucket_id.to_le_bytes());
    mine[12..16].copy_from_slice(&u32::from(setup.is_err()).to_le_bytes());
    mine[16..24].copy_from_slice(&(numel as u64).to_le_bytes());
    let mut all = vec![0u8; RECORD * comm.size()];
    comm.all_gather(&mine, &mut all)?;
    let config = match setup {
        Ok(config) => config,
        Err(reason) => return Err(reason.clone()),
    };
    let records: Vec<&[u8]> = all.chunks_exact(RECORD).collect();
    let field = |r: &[u8], range: std::ops::Range<usize>| {
        let mut word = [0u8; 8];
        word[..range.len()].copy_from_slice(&r[range]);
        u64::from_le_bytes(word)
    };
    if let Some(failed) = records.iter().position(|r| field(r, 12..16) != 0) {
        return Err(Error::Comm(format!(
            "rank {failed} failed to set up bucket {bucket_id} (its own error names the \
             problem); this rank is {}",
            comm.rank()
        )));
    }
    for (rank, record) in records.iter().enumerate().skip(1) {
        for (name, range) in [
            ("config fingerprint", 0..8),
            ("bucket id", 8..12),
            ("bucket size", 16..24),
        ] {
            let (theirs, first) = (field(record, range.clone()), field(records[0], range));
            if theirs != first {
                return Err(Error::Comm(format!(
                    "ranks disagree on the {name}: rank {rank} has {theirs:#x}, rank 0 has \
                     {first:#x} (this rank is {}; its config: {config})",
                    comm.rank()
                )));
            }
        }
    }
    Ok(())
}
