//! `check_ranks_agree`: ranks with the same config and bucket pass; any difference fails on
//! every rank with a message naming the field and the ranks.

use sdp4bit::collective::local::LocalCluster;
use sdp4bit::collective::{Comm, check_ranks_agree};
use sdp4bit::layout::Topology;
use sdp4bit::{Config, Preset};

/// (field named in the error, per-rank configs, bucket ids, bucket sizes).
type Case = (&'static str, [Config; 4], [u32; 4], [usize; 4]);

fn run(configs: &[Config], ids: &[u32], sizes: &[usize]) -> Vec<sdp4bit::Result<()>> {
    let cluster = LocalCluster::new(Topology::uniform(2, 2).unwrap());
    cluster.run(|c| {
        let me = c.world.rank();
        check_ranks_agree(c.world, &configs[me], ids[me], sizes[me])
    })
}

#[test]
fn identical_setups_agree() {
    let cfg = Config::preset(Preset::Sdp4bit);
    for result in run(&[cfg; 4], &[3; 4], &[4096; 4]) {
        result.expect("identical configs and buckets agree");
    }
}

#[test]
fn any_difference_fails_on_every_rank() {
    let base = Config::preset(Preset::Sdp4bit);
    let reseeded = Config::from_overrides(Preset::Sdp4bit, [("seed", "7")]).unwrap();
    let cases: [Case; 4] = [
        (
            "config fingerprint",
            [base, base, reseeded, base],
            [0; 4],
            [64; 4],
        ),
        (
            "config fingerprint",
            [base, base, base, Config::preset(Preset::Qsdp)],
            [0; 4],
            [64; 4],
        ),
        ("bucket id", [base; 4], [0, 1, 0, 0], [64; 4]),
        ("bucket size", [base; 4], [0; 4], [64, 64, 64, 128]),
    ];
    for (field, configs, ids, sizes) in cases {
        let results = run(&configs, &ids, &sizes);
        for (rank, result) in results.iter().enumerate() {
            let e = result
                .as_ref()
                .expect_err("a mismatch must fail on every rank");
            let msg = e.to_string();
            assert!(
                msg.contains(field) && msg.contains("rank 0 has"),
                "rank {rank}: '{msg}' should name the {field} and the ranks"
            );
        }
    }
}

#[test]
fn a_rank_whose_setup_failed_makes_every_rank_fail_at_once() {
    use sdp4bit::Error;
    use sdp4bit::collective::check_setup_agrees;
    let cfg = Config::preset(Preset::Sdp4bit);
    let cluster = LocalCluster::new(Topology::uniform(2, 2).unwrap());
    let results = cluster.run(|c| {
        let reason = Error::Buffer("params must be bfloat16, got float32".to_string());
        let setup = if c.world.rank() == 2 {
            Err(&reason)
        } else {
            Ok(&cfg)
        };
        check_setup_agrees(c.world, setup, 0, 4096)
    });
    for (rank, result) in results.into_iter().enumerate() {
        let message = result.expect_err("every rank fails").to_string();
        if rank == 2 {
            assert!(message.contains("bfloat16"), "{message}");
        } else {
            assert!(
                message.contains("rank 2 failed to set up bucket 0"),
                "{message}"
            );
        }
    }
}
