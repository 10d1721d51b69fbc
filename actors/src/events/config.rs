//! `[events]`: where the node publishes its KV events. Absent: no event log, no socket.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Events kept for replay (and for the engine's `Events` call) by default.
pub const DEFAULT_BUFFER_EVENTS: usize = 10_000;
/// The most `buffer-events` may be: each event holds at most 64 hashes of 32 bytes, so the
/// ring stays under about 2.5 GiB even at this bound.
pub const MAX_BUFFER_EVENTS: usize = 1_000_000;

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case", default)]
pub struct EventsConfig {
    /// The ZMQ PUB endpoint the node binds, `tcp://HOST:PORT`; empty: events are kept
    /// (for the engine's `Events` call) but not published.
    pub publish: String,
    /// The ZMQ ROUTER endpoint answering replay requests; empty: none.
    pub replay: String,
    /// The first frame's prefix; the namespace follows it, so a subscriber filters one
    /// namespace by subscribing to `topic + namespace`.
    pub topic: String,
    /// Events kept in memory for replay; older ones are let go.
    pub buffer_events: usize,
    /// How events are laid out in a batch: `map` (vLLM's current format) or `array` (the
    /// format of vLLM releases whose events were `array_like`).
    pub layout: super::wire::Layout,
}

impl Default for EventsConfig {
    fn default() -> Self {
        Self {
            publish: "tcp://127.0.0.1:5557".into(),
            replay: String::new(),
            topic: "kvferry@".into(),
            buffer_events: DEFAULT_BUFFER_EVENTS,
            layout: super::wire::Layout::Map,
        }
    }
}

/// A `[events]` value out of range; `key` names it.
#[derive(Debug, Error)]
#[error("config key {key}: {reason}")]
pub struct InvalidEventsConfig {
    pub key: &'static str,
    pub reason: String,
}

/// `tcp://HOST:PORT` with a numeric port, or empty.
fn check_endpoint(key: &'static str, value: &str) -> Result<(), InvalidEventsConfig> {
    if value.is_empty() {
        return Ok(());
    }
    let invalid = |reason: String| Err(InvalidEventsConfig { key, reason });
    let Some(rest) = value.strip_prefix("tcp://") else {
        return invalid(format!("{value:?} must be tcp://HOST:PORT"));
    };
    match rest.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(()),
        _ => invalid(format!("{value:?} must be tcp://HOST:PORT")),
    }
}

impl EventsConfig {
    pub fn validate(&self) -> Result<(), InvalidEventsConfig> {
        check_endpoint("events.publish", &self.publish)?;
        check_endpoint("events.replay", &self.replay)?;
        // Port 0 asks the OS for a free port each: two of them never collide.
        if !self.replay.is_empty() && self.replay == self.publish && !self.replay.ends_with(":0") {
            return Err(InvalidEventsConfig {
                key: "events.replay",
                reason: format!("{} is also events.publish", self.replay),
            });
        }
        if !self.replay.is_empty() && self.publish.is_empty() {
            return Err(InvalidEventsConfig {
                key: "events.replay",
                reason: "replays what events.publish sent: set events.publish too".into(),
            });
        }
        if self.topic.len() > 256 || self.topic.chars().any(|c| c.is_control()) {
            return Err(InvalidEventsConfig {
                key: "events.topic",
                reason: "at most 256 bytes, no control characters".into(),
            });
        }
        if self.buffer_events == 0 || self.buffer_events > MAX_BUFFER_EVENTS {
            return Err(InvalidEventsConfig {
                key: "events.buffer-events",
                reason: format!("{} must be 1 to {MAX_BUFFER_EVENTS}", self.buffer_events),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<EventsConfig, toml::de::Error> {
        toml::from_str(text)
    }

    #[test]
    fn defaults_are_loopback_and_valid() {
        let c = EventsConfig::default();
        assert!(c.publish.starts_with("tcp://127.0.0.1:"));
        c.validate().unwrap();
    }

    #[test]
    fn bad_values_name_their_key() {
        for (text, key) in [
            ("publish = \"udp://x:1\"", "events.publish"),
            ("publish = \"tcp://127.0.0.1\"", "events.publish"),
            ("replay = \"tcp://h:99999\"", "events.replay"),
            ("replay = \"tcp://127.0.0.1:5557\"", "events.replay"),
            ("publish = \"\"\nreplay = \"tcp://h:1\"", "events.replay"),
            ("topic = \"a\\u0001\"", "events.topic"),
            ("buffer-events = 0", "events.buffer-events"),
            ("buffer-events = 10000000", "events.buffer-events"),
        ] {
            let c = parse(text).unwrap();
            let e = c.validate().expect_err(text);
            assert_eq!(e.key, key, "{text}");
        }
    }

    #[test]
    fn the_sample_config_loads() {
        let text = include_str!("../../../config/events.toml");
        let cfg = crate::config::NodeConfig::from_toml(text, "config/events.toml").unwrap();
        let ev = cfg.events.expect("[events]");
        assert_eq!(ev.replay, "tcp://127.0.0.1:5558");
        assert_eq!(ev.topic, "kvferry@node-events:");
        let broken = text.replace("buffer-events = 10000", "buffer-events = 0");
        let e = crate::config::NodeConfig::from_toml(&broken, "x").unwrap_err();
        assert!(e.to_string().contains("events.buffer-events"), "{e}");
    }

    #[test]
    fn unknown_keys_are_refused() {
        assert!(parse("publsh = \"tcp://127.0.0.1:1\"").is_err());
        assert!(parse("layout = \"json\"").is_err());
        assert_eq!(
            parse("layout = \"array\"").unwrap().layout,
            super::super::wire::Layout::Array
        );
    }
}
