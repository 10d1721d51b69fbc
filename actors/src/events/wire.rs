//! vLLM's KV event wire format (`vllm/distributed/kv_events.py`), so that a subscriber
//! written for vLLM decodes a node's events unchanged.
//!
//! A message is three ZMQ frames: the topic, the sequence number as 8 big-endian bytes,
//! and a msgpack `KVEventBatch`: the array `[ts, events]` (msgspec `array_like`, the
//! default `data_parallel_rank` omitted). Each event is a msgspec tagged struct, tag
//! field `type` with the class name; how its fields are laid out changed between vLLM
//! releases, so the node speaks both ([`Layout`]):
//! - `Map` (current vLLM): a map `{"type": "BlockStored", "block_hashes": …, …}`;
//! - `Array` (earlier releases, `array_like=True` on the event base class): the array
//!   `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
//!   medium, lora_name]`; decoders of releases with fewer fields ignore the trailing ones.
//!
//! A node knows neither the tokens nor the chain of a block, only its hash: `token_ids` is
//! empty, `parent_block_hash`, `lora_id` and `lora_name` are nil, `block_size` is 0. A
//! router that needs them takes the engine's events (the connector reports them there).

use rmpv::Value;
use serde::{Deserialize, Serialize};

use super::log::{EventKind, NodeEvent};

/// How events are laid out inside a batch (see the module's header).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Layout {
    #[default]
    Map,
    Array,
}

/// The sequence frame vLLM's replay socket ends a replay with (-1 as 8 bytes).
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

fn str_value(s: &str) -> Value {
    Value::String(s.into())
}

fn event_value(e: &NodeEvent, layout: Layout) -> Value {
    let hashes = Value::Array(
        e.hashes
            .iter()
            .map(|h| Value::Binary(h.as_bytes().to_vec()))
            .collect(),
    );
    let medium = str_value(e.medium.as_str());
    let fields: Vec<(&str, Value)> = match e.kind {
        EventKind::Stored => vec![
            ("type", str_value("BlockStored")),
            ("block_hashes", hashes),
            ("parent_block_hash", Value::Nil),
            ("token_ids", Value::Array(Vec::new())),
            ("block_size", Value::from(0)),
            ("lora_id", Value::Nil),
            ("medium", medium),
            ("lora_name", Value::Nil),
        ],
        EventKind::Removed => vec![
            ("type", str_value("BlockRemoved")),
            ("block_hashes", hashes),
            ("medium", medium),
        ],
        EventKind::AllCleared => vec![("type", str_value("AllBlocksCleared"))],
    };
    match layout {
        Layout::Array => Value::Array(fields.into_iter().map(|(_, v)| v).collect()),
        Layout::Map => Value::Map(fields.into_iter().map(|(k, v)| (str_value(k), v)).collect()),
    }
}

/// The msgpack payload of one `KVEventBatch` holding `events` (stamped with the first
/// one's time).
pub fn encode_batch(events: &[NodeEvent], layout: Layout) -> Vec<u8> {
    let ts = events.first().map_or(0.0, |e| e.ts);
    let batch = Value::Array(vec![
        Value::F64(ts),
        Value::Array(events.iter().map(|e| event_value(e, layout)).collect()),
    ]);
    let mut out = Vec::with_capacity(64 + events.len() * 48);
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &batch);
    out
}

/// The topic frame of a namespace's events: the configured prefix, then the namespace; the
/// prefix alone for an event of every namespace (`AllBlocksCleared`), which a subscriber of
/// the whole prefix receives.
pub fn topic(prefix: &str, namespace: Option<&crate::model::Namespace>) -> Vec<u8> {
    let ns = namespace.map_or("", |n| n.as_str());
    let mut t = Vec::with_capacity(prefix.len() + ns.len());
    t.extend_from_slice(prefix.as_bytes());
    t.extend_from_slice(ns.as_bytes());
    t
}

/// Why a replay request was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReplayRequestError {
    /// vLLM's subscribers send `[identity, "", seq]` through a ROUTER: anything else is
    /// refused.
    #[error("a replay request is an empty frame then 8 bytes of sequence; got {frames} frames")]
    Frames { frames: usize },
    #[error("a replay request's sequence is 8 big-endian bytes; got {len}")]
    SeqLength { len: usize },
}

/// The start sequence of a replay request's frames after the ROUTER's identity frame:
/// `["", seq as 8 big-endian bytes]`.
pub fn parse_replay_request(frames: &[&[u8]]) -> Result<u64, ReplayRequestError> {
    match frames {
        [[], seq] => {
            let bytes: [u8; 8] = (*seq)
                .try_into()
                .map_err(|_| ReplayRequestError::SeqLength { len: seq.len() })?;
            Ok(u64::from_be_bytes(bytes))
        }
        _ => Err(ReplayRequestError::Frames {
            frames: frames.len(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::log::Medium;
    use crate::model::{BlockHash, Namespace};

    fn event(kind: EventKind, medium: Medium) -> NodeEvent {
        NodeEvent {
            seq: 3,
            ts: 1.5,
            namespace: Some(Namespace::new("m", "bf16", "f").unwrap()),
            kind,
            medium,
            hashes: vec![
                BlockHash::new(&[1, 2]).unwrap(),
                BlockHash::new(&[3]).unwrap(),
            ],
        }
    }

    fn decode(bytes: &[u8]) -> Value {
        rmpv::decode::read_value(&mut &bytes[..]).unwrap()
    }

    fn hashes() -> Value {
        Value::Array(vec![Value::Binary(vec![1, 2]), Value::Binary(vec![3])])
    }

    #[test]
    fn a_batch_is_ts_then_events_in_map_layout() {
        let evs = [
            event(EventKind::Stored, Medium::Ram),
            event(EventKind::Removed, Medium::Disk),
        ];
        let v = decode(&encode_batch(&evs, Layout::Map));
        let Value::Array(batch) = v else {
            panic!("not an array: {v:?}")
        };
        assert_eq!(batch.len(), 2, "ts and events; the default dp rank omitted");
        assert_eq!(batch[0], Value::F64(1.5));
        let Value::Array(events) = &batch[1] else {
            panic!("events not an array")
        };
        let get = |e: &Value, k: &str| -> Value {
            let Value::Map(m) = e else {
                panic!("event not a map")
            };
            m.iter()
                .find(|(key, _)| key.as_str() == Some(k))
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| panic!("no {k}"))
        };
        // The tag comes first, as msgspec writes it.
        let Value::Map(first) = &events[0] else {
            panic!()
        };
        assert_eq!(first[0].0.as_str(), Some("type"));
        assert_eq!(get(&events[0], "type").as_str(), Some("BlockStored"));
        assert_eq!(get(&events[0], "block_hashes"), hashes());
        assert_eq!(get(&events[0], "medium").as_str(), Some("CPU"));
        assert_eq!(get(&events[0], "parent_block_hash"), Value::Nil);
        assert_eq!(get(&events[0], "token_ids"), Value::Array(vec![]));
        assert_eq!(get(&events[0], "lora_id"), Value::Nil);
        assert_eq!(get(&events[0], "lora_name"), Value::Nil);
        assert_eq!(get(&events[1], "type").as_str(), Some("BlockRemoved"));
        assert_eq!(get(&events[1], "medium").as_str(), Some("DISK"));
    }

    #[test]
    fn the_array_layout_is_positional_with_the_tag_first() {
        let v = decode(&encode_batch(
            &[event(EventKind::Stored, Medium::Disk)],
            Layout::Array,
        ));
        let stored = &v[1][0];
        let Value::Array(f) = stored else {
            panic!("not an array")
        };
        assert_eq!(f[0].as_str(), Some("BlockStored"));
        assert_eq!(f[1], hashes());
        assert_eq!(f[2], Value::Nil);
        assert_eq!(f[3], Value::Array(vec![]));
        assert_eq!(f[4], Value::from(0));
        assert_eq!(f[5], Value::Nil);
        assert_eq!(f[6].as_str(), Some("DISK"));
        let v = decode(&encode_batch(
            &[event(EventKind::Removed, Medium::Ram)],
            Layout::Array,
        ));
        let Value::Array(f) = &v[1][0] else { panic!() };
        assert_eq!(f.len(), 3);
        assert_eq!(f[0].as_str(), Some("BlockRemoved"));
        assert_eq!(f[2].as_str(), Some("CPU"));
    }

    #[test]
    fn replay_requests_are_checked() {
        assert_eq!(parse_replay_request(&[b"", &7u64.to_be_bytes()]), Ok(7));
        assert_eq!(
            parse_replay_request(&[b"", b"\x01"]),
            Err(ReplayRequestError::SeqLength { len: 1 })
        );
        assert_eq!(
            parse_replay_request(&[b"x", &7u64.to_be_bytes()]),
            Err(ReplayRequestError::Frames { frames: 2 })
        );
        assert_eq!(
            parse_replay_request(&[]),
            Err(ReplayRequestError::Frames { frames: 0 })
        );
        assert_eq!(END_SEQ, [0xff; 8]);
    }

    #[test]
    fn the_topic_is_the_prefix_then_the_namespace() {
        let ns = Namespace::new("m", "bf16", "f").unwrap();
        assert_eq!(topic("kv@a:", Some(&ns)), b"kv@a:m/bf16/f");
        assert_eq!(topic("kv@a:", None), b"kv@a:");
    }

    #[test]
    fn a_clear_is_the_tag_alone_in_both_layouts() {
        let cleared = NodeEvent {
            namespace: None,
            hashes: Vec::new(),
            ..event(EventKind::AllCleared, Medium::Ram)
        };
        let v = decode(&encode_batch(std::slice::from_ref(&cleared), Layout::Map));
        assert_eq!(
            v[1][0],
            Value::Map(vec![(str_value("type"), str_value("AllBlocksCleared"))])
        );
        let v = decode(&encode_batch(&[cleared], Layout::Array));
        assert_eq!(v[1][0], Value::Array(vec![str_value("AllBlocksCleared")]));
    }
}
