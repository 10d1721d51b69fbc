//! The `kvferry` binary: `node`, `demo` and `bench`.

mod bench;
mod bench_cluster;
mod bench_engine;
mod bench_remote;
mod bench_ssd;
mod demo;
mod demo_cluster;
mod logging;
mod plot;
mod service;

use clap::{Parser, Subcommand};
use kvferry_actors::config::log::LogSection;
use kvferry_actors::NodeConfig;

#[derive(Parser)]
#[command(
    name = "kvferry",
    version,
    about = "KV-cache blocks from host RAM and peers into GPU KV"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a node from a config file.
    Node {
        #[arg(long)]
        config: String,
        /// Validate the config and exit.
        #[arg(long)]
        check_config: bool,
    },
    /// Put, query, load and verify blocks on an embedded node.
    Demo(demo::DemoArgs),
    /// Measure against baselines taken in the same run.
    #[command(subcommand)]
    Bench(bench::BenchCmd),
    /// An owner node holding benchmark blocks, in its own process (internal).
    #[command(hide = true)]
    Owner(bench_remote::OwnerArgs),
}

/// Crash-only: a panic on any thread (an actor's included: actix and tokio catch those and
/// leave a process that answers UNAVAILABLE forever) prints its message and ends the
/// process at once with status 101, so a supervisor restarts it.
fn exit_on_panic() {
    let print = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        print(info);
        eprintln!("kvferry: panicked; exiting with status 101");
        // SAFETY: `_exit` ends the process without running atexit handlers or other
        // threads' destructors, which may wait on locks the panicking thread holds.
        unsafe { libc::_exit(101) }
    }));
}

fn main() -> std::process::ExitCode {
    exit_on_panic();
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line with the whole cause chain; no backtrace for an operator's mistake.
            logging::fatal(&format!("kvferry: {e:#}"));
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Node {
            config,
            check_config,
        } => {
            let cfg = NodeConfig::load(&config)?;
            if check_config {
                println!("{config}: ok");
                return Ok(());
            }
            let filter = logging::init(&cfg.log)?;
            service::run(cfg, &filter)
        }
        Cmd::Demo(args) => {
            warnings_only()?;
            demo::run(args)
        }
        Cmd::Bench(cmd) => {
            warnings_only()?;
            bench::run(cmd)
        }
        Cmd::Owner(a) => {
            warnings_only()?;
            bench_remote::owner(a)
        }
    }
}

/// The commands other than `node` print their results; the libraries' warnings still show
/// (or what `RUST_LOG` asks for).
fn warnings_only() -> anyhow::Result<()> {
    logging::init(&LogSection {
        level: "warn".into(),
        ..LogSection::default()
    })
    .map(drop)
}
