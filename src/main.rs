use std::process::ExitCode;

use clap::Parser;
use upscale::cli::Cli;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match upscale::cli::run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
