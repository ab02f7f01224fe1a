//! What front ends learn from the core instead of listing it again: the presets, every knob
//! with the values it accepts and its doc, the limits on bucket ids and ranks (the schema),
//! and a parsed config as they use it (its record), as JSON.

use serde_json::{Value, json};

use super::FfiResult;
use super::buckets::ParsedConfig;
use crate::config::{KNOBS, KnobValues, Preset};
use crate::rng::{MAX_BUCKET_ID, MAX_STREAM_RANK};

/// `{"presets": [...], "knobs": [{"name", "doc", "values"}], "limits": {...}}`, where `values`
/// is `{"names": [...]}`, `{"integers": [...]}` or `{"min", "max", "multiple_of"}`.
pub(super) fn schema_json() -> String {
    let knobs: Vec<Value> = KNOBS
        .iter()
        .map(|knob| {
            let values = match knob.values {
                KnobValues::Names(names) => json!({ "names": names }),
                KnobValues::Integers(values) => json!({ "integers": values }),
                KnobValues::Range {
                    min,
                    max,
                    multiple_of,
                } => json!({ "min": min, "max": max, "multiple_of": multiple_of }),
            };
            json!({ "name": knob.name, "doc": knob.doc, "values": values })
        })
        .collect();
    let presets: Vec<&str> = Preset::ALL.iter().map(|p| p.name()).collect();
    json!({
        "presets": presets,
        "knobs": knobs,
        "limits": { "max_bucket_id": MAX_BUCKET_ID, "max_rank": MAX_STREAM_RANK },
    })
    .to_string()
}

impl ParsedConfig {
    /// The config as front ends use it (see the bridge's declaration), as JSON.
    pub(super) fn record_json(&self) -> FfiResult<String> {
        let config = self.config().map_err(|e| e.to_string())?;
        let (weight, grad) = (config.weight.codec, config.grad.codec);
        Ok(json!({
            "weight_codec": weight.name(),
            "grad_codec": grad.name(),
            "compresses_weights": weight.compresses(),
            "compresses_grads": grad.compresses(),
            "keeps_reference": weight.keeps_reference(),
            "grad_quant_start_step": config.grad_quant_start_step,
            "exact_params": config.exact_params.name(),
            "values": config.knob_values(),
            "canonical": config.to_string(),
            "fingerprint": config.fingerprint(),
        })
        .to_string())
    }
}

/// [`MAX_BUCKET_ID`], for the extension's argument checks.
pub(super) fn max_bucket_id() -> u32 {
    MAX_BUCKET_ID
}
