//! The `[log]` section: what the `kvferry` binary's log subscriber writes. The libraries
//! only emit `tracing` events; an embedding application installs its own subscriber and
//! ignores this section.

use serde::{Deserialize, Serialize};
use tracing_subscriber::filter::{LevelFilter, Targets};

use crate::config::ConfigError;

/// How each log line is written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    /// One human-readable line per event: time, level, target, message, fields.
    #[default]
    Text,
    /// One JSON object per line, for a log pipeline.
    Json,
}

impl LogFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Text => "text",
            Self::Json => "json",
        }
    }
}

/// `[log]`: the level (`RUST_LOG`, when set, takes its place) and the line format.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case", default)]
pub struct LogSection {
    /// A level (`error`, `warn`, `info`, `debug`, `trace`, `off`) or comma-separated
    /// `target=level` directives, e.g. `"info,kvferry_actors::remote=debug"`.
    pub level: String,
    pub format: LogFormat,
}

impl Default for LogSection {
    fn default() -> Self {
        Self {
            level: "info".into(),
            format: LogFormat::Text,
        }
    }
}

/// Parses log directives as the binary's subscriber reads them (`[log] level` and
/// `RUST_LOG`): `level`, `target=level`, comma-separated. Span and field filters are not
/// accepted (no regex engine in the binary for them).
pub fn parse_directives(text: &str) -> Result<Targets, String> {
    if text.trim().is_empty() {
        return Err("is empty (expected a level such as \"info\")".into());
    }
    let refuse = |why: String| {
        format!(
            "{text:?} is not a level nor `target=level` directives ({why}); levels: off, error, warn, info, debug, trace"
        )
    };
    // `Targets` reads a bare word as a target at every level; here a bare word must be a
    // level, so that a misspelt one (`"wran"`) is refused rather than logging everything.
    for part in text.split(',').filter(|p| !p.contains('=')) {
        part.trim()
            .parse::<LevelFilter>()
            .map_err(|e| refuse(format!("{part:?}: {e}")))?;
    }
    text.parse::<Targets>().map_err(|e| refuse(e.to_string()))
}

impl LogSection {
    pub fn validate(&self) -> Result<(), ConfigError> {
        parse_directives(&self.level)
            .map(drop)
            .map_err(|reason| ConfigError::Invalid {
                key: "log.level",
                reason,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_and_directives_parse_and_nonsense_is_refused() {
        for ok in [
            "info",
            "warn",
            "OFF",
            "warn,kvferry_actors::remote=debug",
            "kvferry=trace",
        ] {
            let s = LogSection {
                level: ok.into(),
                ..LogSection::default()
            };
            assert!(s.validate().is_ok(), "{ok}");
        }
        for bad in ["", "  ", "loud", "kvferry=loud", "info,=x"] {
            let s = LogSection {
                level: bad.into(),
                ..LogSection::default()
            };
            let e = s.validate().unwrap_err();
            assert!(
                matches!(
                    &e,
                    ConfigError::Invalid {
                        key: "log.level",
                        ..
                    }
                ),
                "{bad}: {e}"
            );
        }
    }

    /// The samples document the section: node.toml its defaults, cluster-redis.toml JSON.
    #[test]
    fn the_samples_parse_to_what_they_say() {
        let node = include_str!("../../../config/node.toml");
        let cfg = crate::NodeConfig::from_toml(node, "node.toml").unwrap();
        assert_eq!(cfg.log, LogSection::default());
        let redis = include_str!("../../../config/cluster-redis.toml");
        let cfg = crate::NodeConfig::from_toml(redis, "cluster-redis.toml").unwrap();
        assert_eq!(cfg.log.format, LogFormat::Json);
        cfg.log.validate().unwrap();
    }

    #[test]
    fn the_section_is_kebab_case_and_refuses_unknown_keys() {
        let s: LogSection = toml::from_str("level = \"debug\"\nformat = \"json\"\n").unwrap();
        assert_eq!(
            s,
            LogSection {
                level: "debug".into(),
                format: LogFormat::Json
            }
        );
        assert!(toml::from_str::<LogSection>("format = \"xml\"\n").is_err());
        assert!(toml::from_str::<LogSection>("colour = true\n").is_err());
        assert_eq!(
            toml::from_str::<LogSection>("").unwrap(),
            LogSection::default()
        );
    }
}
