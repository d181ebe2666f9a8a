//! `ibex`: runs the Ibex parameter-server training job.
//!
//! - `ibex demo`: the whole job locally (2 PS + 2 workers on shm by default), the README's
//!   main command; see `docs/demo.md`.
//! - `ibex launch`: one task of a job, from a spec file, TF_CONFIG or Slurm.
//! - `ibex train --reference`: the same training in one process without a PS, to check the
//!   distributed run against.
#![warn(missing_docs)]

mod data;
mod demo;
mod gpu;
mod launch;
mod model;
mod progress;
mod rng;
mod train;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ibex",
    version,
    about = "Parameter-server training over the Ibex transport"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Train the demo MLP on UCI digits with local PS and worker processes.
    Demo(demo::DemoArgs),
    /// Run one PS or worker task of a job.
    Launch(launch::LaunchArgs),
    /// Train in this process without a PS (the reference the distributed run must match).
    Train(TrainCmd),
}

#[derive(clap::Args)]
struct TrainCmd {
    /// Required: this command only runs the single-process reference.
    #[arg(long)]
    reference: bool,
    /// Start from the initial weights recorded in this report (from `ibex demo --report`),
    /// since the PS, not this process, chose the distributed run's initial values.
    #[arg(long)]
    init_from: Option<PathBuf>,
    /// Write the JSON report here.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Compare the final weights with this report's (a distributed run of the same flags)
    /// and fail beyond the tolerance of `train::MATCH_TOLERANCE`.
    #[arg(long)]
    compare: Option<PathBuf>,
    #[command(flatten)]
    train: train::TrainArgs,
}

fn main() -> ExitCode {
    // Warnings from the transport (peers refused or closed, limits hit) reach stderr.
    ibex_ps::init_logging();
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Demo(a) => demo::run(&a).and_then(|r| {
            if r.test_accuracy < demo::ACCURACY_BAR {
                Err(format!(
                    "test accuracy {:.2}% is below the {:.0}% bar",
                    r.test_accuracy * 100.0,
                    demo::ACCURACY_BAR * 100.0
                ))
            } else {
                Ok(())
            }
        }),
        Cmd::Launch(a) => launch::run(&a),
        Cmd::Train(t) => reference(&t),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn reference(t: &TrainCmd) -> Result<(), String> {
    if !t.reference {
        return Err(
            "`ibex train` runs only the single-process reference: pass --reference \
                    (distributed training is `ibex demo` or `ibex launch`)"
                .into(),
        );
    }
    let initial = match &t.init_from {
        Some(p) => Some(train::Report::read(p)?.initial.ok_or_else(|| {
            format!(
                "{} holds no initial weights (the run did not start at step 0)",
                p.display()
            )
        })?),
        None => None,
    };
    let r = train::run_reference(&t.train, initial)?;
    println!("final test accuracy: {:.2}%", r.test_accuracy * 100.0);
    println!("final training loss: {:.5}", r.train_loss);
    println!("steps/s: {:.1}", r.steps_per_sec);
    if let Some(p) = &t.report {
        r.write(p)?;
    }
    if let Some(p) = &t.compare {
        let other = train::Report::read(p)?;
        if other.steps != r.steps {
            return Err(format!(
                "{} ran {} steps, this reference {}",
                p.display(),
                other.steps,
                r.steps
            ));
        }
        r.mlp_check_same_shape(&other)?;
        let diff = train::max_rel_diff(&other.params, &r.params);
        let loss_diff = (other.train_loss - r.train_loss).abs() / r.train_loss.abs().max(1e-3);
        println!(
            "vs {}: max relative weight difference {diff:.2e}, training-loss difference {loss_diff:.2e} (tolerance {:.0e})",
            p.display(),
            train::MATCH_TOLERANCE
        );
        if diff > train::MATCH_TOLERANCE || loss_diff > train::MATCH_TOLERANCE {
            return Err(format!(
                "the runs differ by more than the tolerance {:.0e}",
                train::MATCH_TOLERANCE
            ));
        }
    }
    Ok(())
}
