//! Prints the transport benchmarks (`cargo run --release -p kvferry-transport --example
//! transport_bench`); the `kvferry bench transport --json` subcommand calls the same functions.

fn main() {
    match kvferry_transport::bench::run_all(&kvferry_transport::bench::BenchConfig::default()) {
        Ok(r) => println!("{r:#?}"),
        Err(e) => {
            eprintln!("bench failed: {e}");
            std::process::exit(1);
        }
    }
}
