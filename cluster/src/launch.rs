//! `ibex launch`: runs one task of a job. The task comes from `--spec FILE --job J --index I`,
//! else from `TF_CONFIG`, else from a Slurm step (`srun`); a PS task runs `ibex_ps::run`, a
//! worker task runs the training loop.

use std::path::PathBuf;
use std::time::Duration;

use ibex_worker::{ClusterSpec, JobKind, Timeouts};

use crate::train::{self, TrainArgs};

/// `ibex launch` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct LaunchArgs {
    /// Cluster spec TOML (`[cluster] ps = [..] workers = [..] transport = ".."`). Without
    /// it the task comes from TF_CONFIG or the Slurm environment.
    #[arg(long)]
    pub spec: Option<PathBuf>,
    /// ps | worker (required with --spec; overrides TF_CONFIG/Slurm otherwise).
    #[arg(long)]
    pub job: Option<JobKind>,
    /// Task index within its job (required with --spec).
    #[arg(long)]
    pub index: Option<usize>,
    /// PS: sync (aggregate all workers per step) or async.
    #[arg(long, default_value = "sync")]
    pub mode: String,
    /// PS: where checkpoints go (default: a directory per shard under the system temp dir).
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// PS: checkpoint every this many steps (0 = only on SIGTERM).
    #[arg(long, default_value_t = 100)]
    pub checkpoint_every: u64,
    /// PS: resume from the newest checkpoint in --checkpoint-dir.
    #[arg(long)]
    pub restore: bool,
    /// A sync step waits this long for every worker's gradients before failing (default:
    /// the spec's `sync_timeout_secs`, else 30). Workers' connect and call deadlines follow
    /// it unless set.
    #[arg(long)]
    pub sync_timeout_secs: Option<f64>,
    /// Worker: how long connecting keeps trying each PS (default: the sync timeout).
    #[arg(long)]
    pub connect_timeout_secs: Option<f64>,
    /// Worker: the deadline of every call to a PS (default: the sync timeout + 10 s).
    #[arg(long)]
    pub call_timeout_secs: Option<f64>,
    /// Worker: ping a quiet PS connection after this many seconds, and drop it when
    /// 5 s pass without an answer (default 3; 0 turns pings off).
    #[arg(long)]
    pub keepalive_secs: Option<f64>,
    /// PS: when a worker misses a sync step (no push within the sync timeout): `fail` the
    /// step, naming the worker, or `continue` without it until it pushes again (see
    /// docs/ps.md, "Failures").
    #[arg(long, default_value = "fail")]
    pub on_worker_loss: String,
    /// PS: serve Prometheus metrics on this address (e.g. 127.0.0.1:0).
    #[arg(long)]
    pub metrics: Option<String>,
    /// Worker: print `tick K` after every step (what `ibex demo` draws its bar from).
    #[arg(long, hide = true)]
    pub ticks: bool,
    /// Worker: write the JSON report here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Training flags (worker tasks).
    #[command(flatten)]
    pub train: TrainArgs,
}

/// Which task this process is.
pub fn resolve(args: &LaunchArgs) -> Result<(ClusterSpec, JobKind, usize), String> {
    let (spec, job, index) = if let Some(path) = &args.spec {
        let spec = ClusterSpec::from_toml_file(path).map_err(|e| e.to_string())?;
        let job = args.job.ok_or("--spec needs --job ps|worker")?;
        let index = args.index.ok_or("--spec needs --index N")?;
        (spec, job, index)
    } else if let Ok(tf) = std::env::var("TF_CONFIG") {
        ClusterSpec::from_tf_config(&tf).map_err(|e| e.to_string())?
    } else if std::env::var_os("SLURM_PROCID").is_some() {
        ClusterSpec::from_slurm_env().map_err(|e| e.to_string())?
    } else {
        return Err("no task given: pass --spec FILE --job ps|worker --index N, or set TF_CONFIG, or run under srun".into());
    };
    let (job, index) = (args.job.unwrap_or(job), args.index.unwrap_or(index));
    let spec = with_timeouts(spec, args)?;
    let n = if job == JobKind::Ps {
        spec.ps.len()
    } else {
        spec.workers.len()
    };
    if index >= n {
        return Err(format!(
            "{job} index {index} is out of range: the spec lists {n} {job} tasks"
        ));
    }
    Ok((spec, job, index))
}

/// The spec with the timeout flags applied over its own settings.
fn with_timeouts(spec: ClusterSpec, args: &LaunchArgs) -> Result<ClusterSpec, String> {
    let secs = |flag: &str, v: f64| {
        Duration::try_from_secs_f64(v)
            .map_err(|_| format!("--{flag} {v} is not a number of seconds (examples: 10, 0.5)"))
    };
    let mut t = spec.timeouts;
    if let Some(v) = args.sync_timeout_secs {
        let keep = (t.keepalive, t.keepalive_timeout);
        t = Timeouts::following(secs("sync-timeout-secs", v)?);
        (t.keepalive, t.keepalive_timeout) = keep;
    }
    if let Some(v) = args.connect_timeout_secs {
        t.connect = secs("connect-timeout-secs", v)?;
    }
    if let Some(v) = args.call_timeout_secs {
        t.call = secs("call-timeout-secs", v)?;
    }
    if let Some(v) = args.keepalive_secs {
        t.keepalive = Some(secs("keepalive-secs", v)?).filter(|k| !k.is_zero());
    }
    spec.with_timeouts(t).map_err(|e| e.to_string())
}

/// Runs the task to completion.
pub fn run(args: &LaunchArgs) -> Result<(), String> {
    let (spec, job, index) = resolve(args)?;
    crate::demo::check_transport(spec.transport)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    match job {
        JobKind::Ps => rt.block_on(run_ps(&spec, index, args)),
        JobKind::Worker => {
            let report = rt.block_on(train::run_worker(&spec, index, &args.train, args.ticks))?;
            if let Some(p) = &args.report {
                report.write(p)?;
            }
            eprintln!(
                "worker {index}: {} steps, test accuracy {:.2}%, {:.1} steps/s, {} recoveries",
                report.steps,
                report.test_accuracy * 100.0,
                report.steps_per_sec,
                report.recoveries
            );
            Ok(())
        }
    }
}

/// Resolves on SIGTERM or Ctrl-C: the PS then checkpoints and shuts down.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        // Without a SIGTERM handler, Ctrl-C still stops it gracefully.
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

async fn run_ps(spec: &ClusterSpec, index: usize, args: &LaunchArgs) -> Result<(), String> {
    let mut config = ibex_ps::PsConfig::new(spec.ps_listen_uri(index));
    config.shard = u32::try_from(index).map_err(|_| format!("PS index {index} is too large"))?;
    config.num_workers = u32::try_from(spec.workers.len())
        .map_err(|_| format!("{} workers is too many", spec.workers.len()))?;
    config.mode = args.mode.parse().map_err(|e| format!("--mode: {e}"))?;
    config.checkpoint_dir = Some(
        args.checkpoint_dir
            .clone()
            .unwrap_or_else(|| std::env::temp_dir().join(format!("ibex-ps-{index}-ckpt"))),
    );
    config.checkpoint_every = args.checkpoint_every;
    config.restore = args.restore;
    config.sync_timeout = spec.timeouts.sync;
    config.on_worker_loss = args
        .on_worker_loss
        .parse()
        .map_err(|e| format!("--on-worker-loss: {e}"))?;
    config.metrics = args.metrics.clone();
    config.transport = ibex_worker::transport_config().map_err(|e| e.to_string())?;
    ibex_ps::run(config, shutdown_signal())
        .await
        .map_err(|e| format!("PS {index}: {e}"))
}
