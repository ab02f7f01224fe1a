//! Topology, padding and the swizzled layout (docs/numerics.md §5).
//!
//! A bucket of `numel` elements splits into `W` contiguous shards of `S = numel / W` elements
//! (rank `z` owns shard `z`, as in Megatron). For the grouped codecs each shard is padded with
//! zeros to `S_pad`, a multiple of `lcm(weight group, grad group * P, Hadamard block)` over the
//! grouped codecs in use (groups are multiples of 32), so no group ever straddles two shards
//! and every size `W` divides is served. Padded elements never leave the rank: they are zeros
//! on the way in and dropped on the way out.
//!
//! Element `e` of shard `z` has the *padded index* `z * S_pad + e`; it is the Philox element
//! index of every quantization of that element (docs/numerics.md §2.3), so the random numbers do
//! not depend on the order in which groups are laid out or processed.

use crate::codec::quant::QuantSpec;
use crate::codec::slab::SlabLayout;
use crate::config::{Config, GradCodec, WeightCodec};
use crate::error::{Error, Result};

/// Which data-parallel peers sit on which node.
///
/// DP rank `z` is the position in the DP group. Nodes are numbered by their smallest DP rank's
/// order of appearance; a rank's local index is its position among its node's ranks in DP
/// order. The intra-node communicator of a rank has its node's ranks in local order; the
/// inter-node communicator has the ranks with the same local index in node order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    node_of: Vec<usize>,
    local_of: Vec<usize>,
    members: Vec<Vec<usize>>,
}

impl Topology {
    /// Builds the topology from one node label per DP rank (any labels; equal labels mean the
    /// same node).
    pub fn from_node_labels(labels: &[u64]) -> Result<Self> {
        if labels.is_empty() {
            return Err(Error::Topology("a DP group needs at least one rank".into()));
        }
        let mut seen: Vec<u64> = Vec::new();
        let mut node_of = Vec::with_capacity(labels.len());
        let mut local_of = Vec::with_capacity(labels.len());
        let mut members: Vec<Vec<usize>> = Vec::new();
        for (rank, label) in labels.iter().enumerate() {
            let node = match seen.iter().position(|l| l == label) {
                Some(node) => node,
                None => {
                    seen.push(*label);
                    members.push(Vec::new());
                    seen.len() - 1
                }
            };
            node_of.push(node);
            local_of.push(members[node].len());
            members[node].push(rank);
        }
        Ok(Self {
            node_of,
            local_of,
            members,
        })
    }

    /// Builds the topology from the DP group's global ranks and the ranks per node
    /// (`LOCAL_WORLD_SIZE`): a rank's node is `global_rank / local_world_size`.
    pub fn from_global_ranks(global_ranks: &[u64], local_world_size: u64) -> Result<Self> {
        if local_world_size == 0 {
            return Err(Error::Topology("local_world_size must be positive".into()));
        }
        let mut sorted = global_ranks.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::Topology(format!(
                "global rank {} appears twice in the DP group {global_ranks:?}",
                w[0]
            )));
        }
        let labels: Vec<u64> = global_ranks.iter().map(|g| g / local_world_size).collect();
        Self::from_node_labels(&labels)
    }

    /// `nodes` nodes of `per_node` ranks each, DP rank `z = node * per_node + local`.
    pub fn uniform(nodes: usize, per_node: usize) -> Result<Self> {
        if nodes == 0 || per_node == 0 {
            return Err(Error::Topology(format!(
                "{nodes} nodes x {per_node} ranks per node is empty"
            )));
        }
        let labels: Vec<u64> = (0..nodes * per_node)
            .map(|z| (z / per_node) as u64)
            .collect();
        Self::from_node_labels(&labels)
    }

    /// W: ranks in the DP group.
    pub fn world(&self) -> usize {
        self.node_of.len()
    }

    /// M: nodes holding ranks of the group.
    pub fn nodes(&self) -> usize {
        self.members.len()
    }

    /// D: ranks per node, or `None` when nodes hold unequal numbers of ranks.
    pub fn per_node(&self) -> Option<usize> {
        let d = self.members[0].len();
        self.members.iter().all(|m| m.len() == d).then_some(d)
    }

    /// Node index of DP rank `z`.
    pub fn node_of(&self, z: usize) -> usize {
        self.node_of[z]
    }

    /// Local index of DP rank `z` on its node.
    pub fn local_of(&self, z: usize) -> usize {
        self.local_of[z]
    }

    /// DP rank at (`node`, `local`).
    pub fn rank_at(&self, node: usize, local: usize) -> usize {
        self.members[node][local]
    }

    /// DP ranks of the intra-node communicator of rank `z`, in local order.
    pub fn intra_group(&self, z: usize) -> &[usize] {
        &self.members[self.node_of[z]]
    }

    /// DP ranks of the inter-node communicator of rank `z`, in node order (uniform only).
    pub fn inter_group(&self, z: usize) -> Vec<usize> {
        let local = self.local_of[z];
        self.members.iter().map(|m| m[local]).collect()
    }
}

/// Shard sizes and padding of one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketPlan {
    /// Elements in the bucket.
    pub numel: usize,
    /// W.
    pub world: usize,
    /// S = numel / W: elements of one rank's shard.
    pub shard_len: usize,
    /// S_pad: the shard padded for the grouped codecs (equal to S when nothing is grouped).
    pub padded_shard_len: usize,
    /// P: pipeline chunks of each shard.
    pub chunks: usize,
}

impl BucketPlan {
    /// Plans a bucket of `numel` elements over `world` ranks for `config`.
    pub fn new(numel: usize, world: usize, config: &Config) -> Result<Self> {
        if numel == 0 {
            return Err(Error::Plan("bucket has 0 elements".into()));
        }
        if world == 0 {
            return Err(Error::Plan("DP world size is 0".into()));
        }
        if !numel.is_multiple_of(world) {
            return Err(Error::Plan(format!(
                "bucket of {numel} elements does not split into {world} equal shards \
                 (Megatron pads buckets to a multiple of the DP size)"
            )));
        }
        let shard_len = numel / world;
        let unit = padding_unit(config);
        let padded_shard_len = shard_len.div_ceil(unit) * unit;
        let chunks = match config.pipeline_chunks {
            Some(chunks) => chunks,
            None => auto_chunks(config, padded_shard_len),
        };
        Ok(Self {
            numel,
            world,
            shard_len,
            padded_shard_len,
            chunks,
        })
    }

    /// Elements of one pipeline chunk of a padded shard.
    pub fn chunk_len(&self) -> usize {
        self.padded_shard_len / self.chunks
    }

    /// Padded index of element `offset` of shard `z`.
    pub fn padded_index(&self, z: usize, offset: usize) -> u64 {
        (z * self.padded_shard_len + offset) as u64
    }

    /// The real (unpadded) elements of shard `z` that fall in `[offset, offset + len)` of its
    /// padded shard, as a range into the bucket; empty when all are padding.
    pub fn real_range(&self, z: usize, offset: usize, len: usize) -> std::ops::Range<usize> {
        let start = offset.min(self.shard_len);
        let end = (offset + len).min(self.shard_len);
        z * self.shard_len + start..z * self.shard_len + end
    }
}

fn lcm(a: usize, b: usize) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 { a } else { gcd(b, a % b) }
    }
    a / gcd(a, b) * b
}

/// Most chunks the automatic choice cuts a shard into.
pub const AUTO_MAX_CHUNKS: usize = 8;
/// Fewest padded-shard elements of one automatically chosen chunk: below this the per-exchange
/// latency and per-pass start-up would cost more than the overlap gains.
pub const AUTO_MIN_CHUNK_ELEMS: usize = 1 << 18;

/// The multiple every padded shard must be: `lcm(weight group, grad group * P, Hadamard block)`
/// over the grouped codecs in use (1 when none is grouped: no padding), with `P = 1` when the
/// chunks are chosen automatically (the choice never adds padding).
fn padding_unit(config: &Config) -> usize {
    let mut unit = 1;
    if config.weight.codec != WeightCodec::None {
        unit = lcm(unit, config.weight.group_size);
    }
    if config.grad.codec.is_grouped() {
        unit = lcm(
            unit,
            config.grad.group_size * config.pipeline_chunks.unwrap_or(1),
        );
    }
    if let Some(block) = config.grad.hadamard_block {
        unit = lcm(unit, block);
    }
    unit
}

/// The automatic P of a bucket whose padded shard has `padded_shard_len` elements (docs/numerics.md
/// §5.4): the largest `P <= AUTO_MAX_CHUNKS` whose chunks hold whole gradient groups (hence
/// whole Hadamard blocks, which divide the group) of the shard as padded for `P = 1` and at
/// least `AUTO_MIN_CHUNK_ELEMS` elements; 1 for codecs without groups. A function of the config
/// and the bucket size only, so every rank that agrees on both chooses the same P, and the
/// bytes are those of `P = 1`: the same padding, the same groups, the same element indices.
pub fn auto_chunks(config: &Config, padded_shard_len: usize) -> usize {
    if !config.grad.codec.is_grouped() {
        return 1;
    }
    let group = config.grad.group_size;
    (1..=AUTO_MAX_CHUNKS)
        .rev()
        .find(|&p| {
            padded_shard_len.is_multiple_of(p * group)
                && padded_shard_len / p >= AUTO_MIN_CHUNK_ELEMS
        })
        .unwrap_or(1)
}

/// Which communicator an exchange level runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// The ranks of this node (size D).
    Intra,
    /// The ranks with this rank's local index on every node (size M).
    Inter,
    /// All W ranks.
    World,
}

/// How the grouped gradient reduce-scatter runs on a topology: zero, one or two exchanges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GradRoute {
    /// The exchanges in order, each with its bits; empty when W == 1 (a copy).
    pub levels: Vec<(Level, u8)>,
    /// A notice for the log when the topology forced a degraded route.
    pub notice: Option<String>,
}

impl GradRoute {
    /// The route of `config`'s gradient codec (which must be grouped) on `topology`.
    pub fn new(config: &Config, topology: &Topology) -> Self {
        let g = &config.grad;
        let w = topology.world();
        let (levels, notice) = if w == 1 {
            (vec![], None)
        } else if g.codec == GradCodec::Qsdp {
            (vec![(Level::World, g.inter_bits)], None)
        } else {
            match topology.per_node() {
                None => (
                    vec![(Level::World, g.inter_bits)],
                    Some(format!(
                        "nodes hold unequal numbers of DP ranks ({:?}); the two-level gradient \
                         path is unavailable, running one level over all {w} ranks at {} bits",
                        (0..topology.nodes())
                            .map(|n| topology.intra_group(topology.rank_at(n, 0)).len())
                            .collect::<Vec<_>>(),
                        g.inter_bits
                    )),
                ),
                Some(d) if d == w => (vec![(Level::Intra, g.intra_bits)], None),
                Some(1) => (vec![(Level::Inter, g.inter_bits)], None),
                Some(_) => (
                    vec![(Level::Intra, g.intra_bits), (Level::Inter, g.inter_bits)],
                    None,
                ),
            }
        };
        Self { levels, notice }
    }
}

/// Peer index of destination rank `z` in the communicator of `level`.
pub fn peer_index(topology: &Topology, level: Level, z: usize) -> usize {
    match level {
        Level::Intra => topology.local_of(z),
        Level::Inter => topology.node_of(z),
        Level::World => z,
    }
}

/// Size of the communicator of `level`.
pub fn level_size(topology: &Topology, level: Level) -> usize {
    match level {
        Level::Intra => topology.per_node().unwrap_or(1),
        Level::Inter => topology.nodes(),
        Level::World => topology.world(),
    }
}

/// One exchange of the grouped gradient path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LevelLayout {
    /// The communicator it runs on.
    pub level: Level,
    /// Ranks in that communicator.
    pub peers: usize,
    /// What this rank sends each peer per pipeline chunk.
    pub slab: SlabLayout,
}

/// The swizzled layout of the grouped gradient reduce-scatter (docs/numerics.md §5.4).
///
/// A destination rank `z` has coordinates `(x1, x2)`: its peer index in the first and second
/// exchange (`x2 = 0` with one exchange). The first quantization writes groups in the order
/// `[chunk p][x1][x2][group j]`, so each exchange is a plain equal-split all-to-all: the slab
/// for first-level peer `x1` of chunk `p` holds, for every `x2`, the `Gc` groups of chunk `p`
/// of destination `(x1, x2)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GradLayout {
    /// Shards and padding.
    pub bucket: BucketPlan,
    /// The first exchange (`Gc * second.peers` groups per slab).
    pub first: LevelLayout,
    /// The second exchange (`Gc` groups per slab), if any.
    pub second: Option<LevelLayout>,
    /// Hadamard block, when smoothing is on.
    pub hadamard: Option<usize>,
    dests: Vec<usize>,
}

impl GradLayout {
    /// The layout of `route` for a bucket; `None` when the route has no exchange (W == 1).
    pub fn new(
        config: &Config,
        topology: &Topology,
        route: &GradRoute,
        bucket: BucketPlan,
    ) -> Option<Self> {
        let (first_level, first_bits) = *route.levels.first()?;
        let groups = bucket.chunk_len() / config.grad.group_size;
        let level_layout = |level: Level, bits: u8, groups: usize| LevelLayout {
            level,
            peers: level_size(topology, level),
            slab: SlabLayout {
                spec: QuantSpec::of_grads(&config.grad, bits),
                groups,
            },
        };
        let second = route
            .levels
            .get(1)
            .map(|&(level, bits)| level_layout(level, bits, groups));
        let d2 = second.map_or(1, |s| s.peers);
        let first = level_layout(first_level, first_bits, groups * d2);
        let mut dests = vec![0; first.peers * d2];
        for z in 0..topology.world() {
            let x1 = peer_index(topology, first.level, z);
            let x2 = second.map_or(0, |s| peer_index(topology, s.level, z));
            dests[x1 * d2 + x2] = z;
        }
        Some(Self {
            bucket,
            first,
            second,
            hadamard: config.grad.hadamard_block,
            dests,
        })
    }

    /// Gc: groups per destination rank per pipeline chunk.
    pub fn groups_per_chunk(&self) -> usize {
        self.bucket.chunk_len() / self.first.slab.spec.group_size
    }

    /// Peers of the second exchange (1 when there is none).
    pub fn second_peers(&self) -> usize {
        self.second.map_or(1, |s| s.peers)
    }

    /// DP rank with first-level index `x1` and second-level index `x2`.
    pub fn dest(&self, x1: usize, x2: usize) -> usize {
        self.dests[x1 * self.second_peers() + x2]
    }

    /// The exchange whose receive buffer the final dequantize-sum reads.
    pub fn last(&self) -> LevelLayout {
        self.second.unwrap_or(self.first)
    }
}
