//! Accounting of the bytes one rank puts on the wire per collective call.

use crate::layout::Topology;

/// Bytes one rank sends to other ranks in one call, split by whether the peer shares its node.
/// Exchanges are counted as direct sends (each rank sends each peer what that peer needs), the
/// model under which an uncompressed reduce-scatter or all-gather moves `(W - 1) * S` elements
/// per rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WireBytes {
    /// To peers on the same node.
    pub intra_node: u64,
    /// To peers on other nodes.
    pub inter_node: u64,
}

impl WireBytes {
    /// Intra- plus inter-node bytes.
    pub fn total(&self) -> u64 {
        self.intra_node + self.inter_node
    }

    /// `bytes` sent to every other rank of the DP group.
    pub(crate) fn to_every_peer(topology: &Topology, me: usize, bytes: usize) -> Self {
        let same_node = topology.intra_group(me).len() as u64 - 1;
        let other_nodes = (topology.world() - topology.intra_group(me).len()) as u64;
        Self {
            intra_node: same_node * bytes as u64,
            inter_node: other_nodes * bytes as u64,
        }
    }
}
