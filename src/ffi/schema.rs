//! What front ends learn from the core instead of listing it again: the presets, every knob
//! with the values it accepts and its doc, the limits on bucket ids and ranks (the schema),
//! and a parsed config's knob values, as JSON.

use serde_json::{Value, json};

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
    /// Every knob's value as text, `null` where the configured codecs do not use it.
    pub(super) fn knob_values_json(&self) -> String {
        let values: serde_json::Map<String, Value> = self
            .0
            .knob_values()
            .into_iter()
            .map(|(name, value)| (name.to_string(), value.map_or(Value::Null, Value::String)))
            .collect();
        Value::Object(values).to_string()
    }
}

/// [`MAX_BUCKET_ID`], for the extension's argument checks.
pub(super) fn max_bucket_id() -> u32 {
    MAX_BUCKET_ID
}
