//! Config parsing and the per-bucket collectives behind the bridge.

use half::bf16;

use super::bridge::{TorchComms, WireBytes};
use super::torch_comm::TorchLevels;
use super::{FfiResult, guard};
use crate::collective::{self, Comm, GradReduceScatter, WeightAllGather};
use crate::config::{Config, Preset};
use crate::error::{Error, Result};
use crate::plan::Topology;

/// A validated [`Config`].
pub(super) struct ParsedConfig(pub(super) Config);

/// Parses `preset[;knob=value]*` into a validated config.
pub(super) fn parse_config(spec: &str) -> FfiResult<Box<ParsedConfig>> {
    guard("parse_config", || parse(spec).map(Box::new))
}

fn parse(spec: &str) -> Result<ParsedConfig> {
    let mut parts = spec.split(';').map(str::trim).filter(|p| !p.is_empty());
    let preset: Preset = parts
        .next()
        .ok_or_else(|| Error::Config("empty config: expected a preset name".to_string()))?
        .parse()
        .map_err(Error::Config)?;
    let overrides = parts
        .map(|part| {
            part.split_once('=')
                .map(|(k, v)| (k.trim(), v.trim()))
                .ok_or_else(|| Error::Config(format!("'{part}' is not of the form knob=value")))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(ParsedConfig(Config::from_overrides(preset, overrides)?))
}

impl ParsedConfig {
    pub(super) fn describe(&self) -> String {
        self.0.to_string()
    }

    pub(super) fn fingerprint(&self) -> u64 {
        self.0.fingerprint()
    }
}

/// The topology of a DP group from each rank's node label.
fn topology(node_labels: &[u64]) -> Result<Topology> {
    Topology::from_node_labels(node_labels)
}

/// [`GradReduceScatter`] for the extension.
pub(super) struct GradBucket(GradReduceScatter);

pub(super) fn new_grad_bucket(
    config: &ParsedConfig,
    node_labels: &[u64],
    rank: usize,
    numel: usize,
    bucket_id: u32,
) -> FfiResult<Box<GradBucket>> {
    guard("new_grad_bucket", || {
        let topology = topology(node_labels)?;
        GradReduceScatter::new(&config.0, &topology, rank, numel, bucket_id)
            .map(|rs| Box::new(GradBucket(rs)))
    })
}

impl GradBucket {
    pub(super) fn shard_len(&self) -> usize {
        self.0.plan().shard_len
    }

    pub(super) fn quantizes_at(&self, step: u64) -> bool {
        self.0.quantizes_at(step)
    }

    pub(super) fn wire_bytes(&self, step: u64) -> WireBytes {
        self.0.wire_bytes(step).into()
    }

    pub(super) fn baseline_wire_bytes(&self) -> WireBytes {
        self.0.baseline_wire_bytes().into()
    }

    pub(super) fn notice(&self) -> String {
        self.0.notice().unwrap_or_default().to_string()
    }

    pub(super) fn run(
        &mut self,
        comms: &TorchComms,
        bucket: &[f32],
        shard: &mut [f32],
        step: u64,
    ) -> FfiResult<()> {
        guard("GradBucket::run", || {
            let levels = TorchLevels::new(comms)?;
            self.0.run(&levels.groups(), bucket, shard, step)
        })
    }
}

/// [`WeightAllGather`] for the extension; params cross the bridge as bf16 bit patterns.
pub(super) struct WeightBucket(WeightAllGather);

pub(super) fn new_weight_bucket(
    config: &ParsedConfig,
    node_labels: &[u64],
    rank: usize,
    bucket_id: u32,
    params: &[u16],
) -> FfiResult<Box<WeightBucket>> {
    guard("new_weight_bucket", || {
        let topology = topology(node_labels)?;
        let params: &[bf16] = bytemuck::cast_slice(params);
        WeightAllGather::new(&config.0, &topology, rank, bucket_id, params)
            .map(|ag| Box::new(WeightBucket(ag)))
    })
}

impl WeightBucket {
    pub(super) fn shard_len(&self) -> usize {
        self.0.plan().shard_len
    }

    pub(super) fn wire_bytes(&self) -> WireBytes {
        self.0.wire_bytes().into()
    }

    pub(super) fn baseline_wire_bytes(&self) -> WireBytes {
        self.0.baseline_wire_bytes().into()
    }

    pub(super) fn run(
        &mut self,
        comms: &TorchComms,
        params: &mut [u16],
        step: u64,
    ) -> FfiResult<()> {
        guard("WeightBucket::run", || {
            let levels = TorchLevels::new(comms)?;
            self.0
                .run(levels.world(), bytemuck::cast_slice_mut(params), step)
        })
    }
}

pub(super) fn agree_on_setup(
    comms: &TorchComms,
    spec: &str,
    local_error: &str,
    bucket_id: u32,
    numel: usize,
) -> FfiResult<Box<ParsedConfig>> {
    guard("agree_on_setup", || {
        let levels = TorchLevels::new(comms)?;
        let world = levels.world();
        let parsed = if local_error.is_empty() {
            parse(spec)
        } else {
            Err(Error::Buffer(local_error.to_string()))
        };
        let setup = parsed.as_ref().map(|config| &config.0);
        collective::check_setup_agrees(world, setup, bucket_id, numel).map_err(|e| match e {
            Error::Comm(message) => Error::Comm(format!(
                "{message} [DP rank {} of {}]",
                world.rank(),
                world.size()
            )),
            other => other,
        })?;
        parsed.map(Box::new)
    })
}
