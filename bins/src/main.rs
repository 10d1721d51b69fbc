//! The `kvferry` binary: `node`, `demo` and `bench`.

mod bench;
mod bench_cluster;
mod bench_remote;
mod demo;
mod demo_cluster;
mod plot;
mod service;

use clap::{Parser, Subcommand};
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

fn main() -> std::process::ExitCode {
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line with the whole cause chain; no backtrace for an operator's mistake.
            eprintln!("kvferry: {e:#}");
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
            service::run(cfg)
        }
        Cmd::Demo(args) => demo::run(args),
        Cmd::Bench(cmd) => bench::run(cmd),
        Cmd::Owner(a) => bench_remote::owner(a),
    }
}
