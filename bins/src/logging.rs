//! The binary's log subscriber: `tracing` events of every crate to stderr, as text or JSON
//! lines (`[log] format`), filtered by `RUST_LOG` when it is set, else by `[log] level`.
//!
//! The lifecycle lines that supervisors and scripts match (`kvferry node <id>: started …`,
//! `… stopping on SIGTERM`, `… stopped`, `kvferry: <cause>`) keep their exact text: in text
//! format they are written as they always were, without a timestamp or level in front; in
//! JSON format they are events like the others, with the same text as their message, so
//! a log pipeline gets JSON only.

use std::sync::OnceLock;

use anyhow::Context;
use kvferry_actors::config::log::{parse_directives, LogFormat, LogSection};

static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// The target of the lifecycle events in JSON format.
const LIFECYCLE: &str = "kvferry::lifecycle";

/// The filter in force: `RUST_LOG` (`env`) when set and not empty, else `level`.
fn directives(
    env: Option<&str>,
    level: &str,
) -> anyhow::Result<(tracing_subscriber::filter::Targets, String)> {
    match env {
        Some(env) if !env.trim().is_empty() => parse_directives(env)
            .map(|t| (t, format!("RUST_LOG={env}")))
            .map_err(|e| anyhow::anyhow!("RUST_LOG {e}")),
        _ => parse_directives(level)
            .map(|t| (t, level.to_owned()))
            .map_err(|e| anyhow::anyhow!("log.level {e}")),
    }
}

/// Installs the process's subscriber; returns the filter in force, for the start-up
/// summary. Called once, before the node starts, so its first events are kept.
pub fn init(section: &LogSection) -> anyhow::Result<String> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let env = std::env::var("RUST_LOG").ok();
    let (filter, shown) = directives(env.as_deref(), &section.level)?;
    // The lifecycle lines are written whatever the level, as they are in text format.
    let filter = filter.with_target(LIFECYCLE, tracing::Level::INFO);
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let registry = tracing_subscriber::registry().with(filter);
    match section.format {
        LogFormat::Text => registry.with(fmt).try_init(),
        LogFormat::Json => registry
            .with(fmt.json().flatten_event(true).with_current_span(true))
            .try_init(),
    }
    .context("installing the log subscriber")?;
    let _ = FORMAT.set(section.format);
    Ok(shown)
}

/// A lifecycle line with its stable text (see the module's note).
pub fn lifecycle(line: &str) {
    match FORMAT.get() {
        Some(LogFormat::Json) => tracing::info!(target: LIFECYCLE, "{line}"),
        _ => eprintln!("{line}"),
    }
}

/// The last line of a failed run: `kvferry: <cause>`.
pub fn fatal(line: &str) {
    match FORMAT.get() {
        Some(LogFormat::Json) => tracing::error!(target: LIFECYCLE, "{line}"),
        _ => eprintln!("{line}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `RUST_LOG` wins over `[log] level`; a bad one is refused, naming it.
    #[test]
    fn rust_log_takes_the_place_of_the_config_level() {
        let (_, shown) = directives(Some("debug,h2=warn"), "info").unwrap();
        assert_eq!(shown, "RUST_LOG=debug,h2=warn");
        let e = directives(Some("loud"), "info").unwrap_err().to_string();
        assert!(e.starts_with("RUST_LOG "), "{e}");
        assert_eq!(directives(Some(" "), "warn").unwrap().1, "warn");
        let e = directives(None, "loud").unwrap_err().to_string();
        assert!(e.starts_with("log.level "), "{e}");
    }
}
