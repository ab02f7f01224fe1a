//! The configs and topologies the collective sweeps run on.

use sdp4bit::layout::Topology;
use sdp4bit::{Config, Preset};

/// `Config::from_overrides`, unwrapped with the overrides in the message.
pub fn cfg(preset: Preset, overrides: &[(&str, &str)]) -> Config {
    Config::from_overrides(preset, overrides.iter().copied())
        .unwrap_or_else(|e| panic!("config {preset} {overrides:?}: {e}"))
}

/// `(D, M)`: ranks per node and nodes, every factorisation of W in {1, 2, 3, 4, 6, 8}
/// (D = 1 and M = 1 included).
pub const FACTORS: [(usize, usize); 16] = [
    (1, 1),
    (1, 2),
    (2, 1),
    (1, 3),
    (3, 1),
    (2, 2),
    (1, 4),
    (4, 1),
    (3, 2),
    (2, 3),
    (6, 1),
    (1, 6),
    (2, 4),
    (4, 2),
    (8, 1),
    (1, 8),
];

/// Every uniform `D x M` topology of [`FACTORS`], a non-uniform one (3 + 1 ranks), another
/// non-uniform one (1 + 2, arbitrary labels) and an interleaved uniform one (DP ranks 0, 2 on
/// one node, 1, 3 on the other), each with a name for failure messages.
pub fn all_topologies() -> Vec<(String, Topology)> {
    let mut out: Vec<(String, Topology)> = FACTORS
        .iter()
        .map(|&(d, m)| {
            (
                format!("D={d} x M={m}"),
                Topology::uniform(m, d).expect("uniform topology"),
            )
        })
        .collect();
    for (name, labels) in [
        ("labels [0,0,0,1] (non-uniform)", vec![0u64, 0, 0, 1]),
        ("labels [7,3,3] (non-uniform)", vec![7, 3, 3]),
        ("labels [0,1,0,1] (interleaved 2x2)", vec![0, 1, 0, 1]),
    ] {
        out.push((
            name.to_string(),
            Topology::from_node_labels(&labels).expect("labelled topology"),
        ));
    }
    out
}
