//! `ibex-ps` configuration: command-line flags over an optional TOML file (same keys, with
//! underscores: `listen`, `shard`, `num_workers`, `mode`, `checkpoint_dir`,
//! `checkpoint_every`, `restore`, `metrics`, `sync_timeout_secs`, `on_worker_loss`,
//! `keepalive_secs`, `max_variables`, `max_elements`, `max_bytes`, `max_connections`).

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use crate::PsError;
use crate::shard::{Limits, Mode, ShardConfig, WorkerLoss};

/// Workers' connections are pinged after this long without a word from them: a worker
/// whose host vanished is noticed within this plus [`DEFAULT_KEEPALIVE_TIMEOUT`].
pub const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(3);
/// How long a ping may go unanswered.
pub const DEFAULT_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// Everything one PS shard needs.
#[derive(Debug, Clone)]
pub struct PsConfig {
    /// `shm:///path.sock`, `tcp://host:port`, `verbs://host:port`, or `http://host:port` (stock gRPC).
    pub listen: String,
    /// This shard's index.
    pub shard: u32,
    /// Workers in each sync step.
    pub num_workers: u32,
    /// Sync or async.
    pub mode: Mode,
    /// Checkpoint directory; none disables checkpoints.
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint after every K-th applied step (0: only on shutdown and `Save`).
    pub checkpoint_every: u64,
    /// Start from the newest checkpoint in `checkpoint_dir`.
    pub restore: bool,
    /// `host:port` for `/metrics` (port 0 picks one; printed at start).
    pub metrics: Option<String>,
    /// How long a sync push or pull waits for the other workers.
    pub sync_timeout: Duration,
    /// What a sync step does when a worker has not pushed by then.
    pub on_worker_loss: WorkerLoss,
    /// Ping a worker's connection after this long without hearing from it, and close it
    /// when [`PsConfig::keepalive_timeout`] passes without an answer, so a worker whose
    /// host vanished stops holding its calls; `None`: no pings. `IBEX_KEEPALIVE_MS` /
    /// `IBEX_KEEPALIVE_TIMEOUT_MS`, when set, win.
    pub keepalive: Option<Duration>,
    /// See [`PsConfig::keepalive`].
    pub keepalive_timeout: Duration,
    /// What workers may make this shard hold.
    pub limits: Limits,
    /// Bounds on pull replies exposed for one-sided reads (library only; defaults from
    /// the binary).
    pub expose: crate::ExposeLimits,
    /// The transport's settings for worker connections: `Config::default()` from
    /// [`PsConfig::new`], `Config::from_env()` (the `IBEX_*` variables) from the command line.
    pub transport: ibex_transport::Config,
}

impl PsConfig {
    /// Defaults for `listen`: one worker, sync mode, no checkpoints, 30 s timeout.
    pub fn new(listen: impl Into<String>) -> PsConfig {
        PsConfig {
            listen: listen.into(),
            shard: 0,
            num_workers: 1,
            mode: Mode::Sync,
            checkpoint_dir: None,
            checkpoint_every: 0,
            restore: false,
            metrics: None,
            sync_timeout: Duration::from_secs(30),
            on_worker_loss: WorkerLoss::Fail,
            keepalive: Some(DEFAULT_KEEPALIVE),
            keepalive_timeout: DEFAULT_KEEPALIVE_TIMEOUT,
            limits: Limits::default(),
            expose: crate::ExposeLimits::default(),
            transport: ibex_transport::Config::default(),
        }
    }

    /// Parses `ibex-ps` flags (`args` includes the program name) and the `--config` file.
    pub fn from_args<I: IntoIterator<Item = String>>(args: I) -> Result<PsConfig, PsError> {
        let a = Args::try_parse_from(args).map_err(|e| PsError::Config(e.to_string()))?;
        let file: FileConfig = match &a.config {
            Some(p) => {
                let s = std::fs::read_to_string(p)
                    .map_err(|e| PsError::Config(format!("{}: {e}", p.display())))?;
                toml::from_str(&s).map_err(|e| PsError::Config(format!("{}: {e}", p.display())))?
            }
            None => FileConfig::default(),
        };
        let listen = a
            .listen
            .or(file.listen)
            .ok_or_else(|| PsError::Config("--listen URI is required".into()))?;
        let mode = match a.mode {
            Some(m) => m.parse().map_err(PsError::Config)?,
            None => file.mode.unwrap_or(Mode::Sync),
        };
        let num_workers = a.num_workers.or(file.num_workers).unwrap_or(1);
        if num_workers == 0 {
            return Err(PsError::Config("--num-workers must be at least 1".into()));
        }
        let d = Limits::default();
        let limits = Limits {
            max_variables: a
                .max_variables
                .or(file.max_variables)
                .unwrap_or(d.max_variables),
            max_elements: a
                .max_elements
                .or(file.max_elements)
                .unwrap_or(d.max_elements),
            max_bytes: a.max_bytes.or(file.max_bytes).unwrap_or(d.max_bytes),
        };
        let mut transport =
            ibex_transport::Config::from_env().map_err(|e| PsError::Config(e.to_string()))?;
        match a.max_connections.or(file.max_connections) {
            Some(0) => {
                return Err(PsError::Config(
                    "--max-connections must be at least 1 (leave it out to follow ulimit -n)"
                        .into(),
                ));
            }
            Some(n) => transport.max_connections = Some(n),
            None => {}
        }
        if let Some(m) = a.max_memory.or(file.max_memory) {
            transport.max_memory = ibex_transport::config::parse_size(&m).ok_or_else(|| {
                PsError::Config(format!(
                    "--max-memory {m:?} is not a size (examples: 512M, 2G)"
                ))
            })?;
            transport
                .validate()
                .map_err(|e| PsError::Config(e.to_string()))?;
        }
        Ok(PsConfig {
            limits,
            listen,
            shard: a.shard.or(file.shard).unwrap_or(0),
            num_workers,
            mode,
            checkpoint_dir: a.checkpoint_dir.or(file.checkpoint_dir),
            checkpoint_every: a.checkpoint_every.or(file.checkpoint_every).unwrap_or(0),
            restore: a.restore || file.restore.unwrap_or(false),
            metrics: a.metrics.or(file.metrics),
            sync_timeout: Duration::from_secs(
                a.sync_timeout_secs.or(file.sync_timeout_secs).unwrap_or(30),
            ),
            on_worker_loss: match a.on_worker_loss {
                Some(p) => p.parse().map_err(PsError::Config)?,
                None => file.on_worker_loss.unwrap_or_default(),
            },
            keepalive: match a.keepalive_secs.or(file.keepalive_secs) {
                Some(0) => None,
                Some(k) => Some(Duration::from_secs(k)),
                None => Some(DEFAULT_KEEPALIVE),
            },
            keepalive_timeout: DEFAULT_KEEPALIVE_TIMEOUT,
            expose: crate::ExposeLimits::default(),
            transport,
        })
    }

    pub(crate) fn shard_config(&self) -> ShardConfig {
        ShardConfig {
            shard: self.shard,
            num_workers: self.num_workers,
            mode: self.mode,
            sync_timeout: self.sync_timeout,
            on_worker_loss: self.on_worker_loss,
            checkpoint_dir: self.checkpoint_dir.clone(),
            checkpoint_every: self.checkpoint_every,
            limits: self.limits,
        }
    }
}

/// Parameter-server shard for Ibex training jobs.
#[derive(Parser, Debug)]
#[command(name = "ibex-ps")]
struct Args {
    /// URI to serve on: shm:///path.sock, tcp://host:port, verbs://host:port, http://host:port (stock gRPC).
    #[arg(long)]
    listen: Option<String>,
    /// This shard's index.
    #[arg(long)]
    shard: Option<u32>,
    /// Workers taking part in each sync step.
    #[arg(long)]
    num_workers: Option<u32>,
    /// sync or async.
    #[arg(long)]
    mode: Option<String>,
    /// Directory for checkpoints (per shard: DIR/shard-I/step-S.safetensors).
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Checkpoint after every K-th applied step (0: only on SIGTERM and Save).
    #[arg(long)]
    checkpoint_every: Option<u64>,
    /// Resume from the newest checkpoint in --checkpoint-dir.
    #[arg(long)]
    restore: bool,
    /// TOML file with the same settings (flags win).
    #[arg(long)]
    config: Option<PathBuf>,
    /// host:port for Prometheus /metrics (port 0 picks one).
    #[arg(long)]
    metrics: Option<String>,
    /// Seconds a sync push or pull waits for missing workers before DEADLINE_EXCEEDED.
    #[arg(long)]
    sync_timeout_secs: Option<u64>,
    /// fail (default): a sync step that a worker misses fails with DEADLINE_EXCEEDED
    /// naming it; continue: the step completes with the workers that pushed, and the
    /// missing ones rejoin with their next push.
    #[arg(long)]
    on_worker_loss: Option<String>,
    /// Ping a quiet worker connection after this many seconds and close it when 5 s pass
    /// without an answer (default 3; 0: off).
    #[arg(long)]
    keepalive_secs: Option<u64>,
    /// Most variables (or partitions) this shard holds.
    #[arg(long)]
    max_variables: Option<u64>,
    /// Most f32 elements over all variables of this shard.
    #[arg(long)]
    max_elements: Option<u64>,
    /// Most bytes of values and optimizer slots over all variables of this shard.
    #[arg(long)]
    max_bytes: Option<u64>,
    /// The budget for what clients make this server hold (calls in flight, unread request
    /// bytes, unsent answers), e.g. 2G; past it the heaviest clients are paused and their
    /// new calls refused (default: a quarter of the machine's memory; IBEX_MAX_MEMORY).
    #[arg(long)]
    max_memory: Option<String>,
    /// Most worker connections open at once; past it a newcomer replaces the connection
    /// idle longest, or is refused (default: from ulimit -n, less a reserve).
    #[arg(long)]
    max_connections: Option<usize>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<String>,
    shard: Option<u32>,
    num_workers: Option<u32>,
    mode: Option<Mode>,
    checkpoint_dir: Option<PathBuf>,
    checkpoint_every: Option<u64>,
    restore: Option<bool>,
    metrics: Option<String>,
    sync_timeout_secs: Option<u64>,
    on_worker_loss: Option<WorkerLoss>,
    keepalive_secs: Option<u64>,
    max_variables: Option<u64>,
    max_elements: Option<u64>,
    max_bytes: Option<u64>,
    max_memory: Option<String>,
    max_connections: Option<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_override_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("ps.toml");
        std::fs::write(&f, "listen = \"tcp://127.0.0.1:7000\"\nnum_workers = 4\nmode = \"async\"\ncheckpoint_every = 5\n").unwrap();
        let args = [
            "ibex-ps",
            "--config",
            f.to_str().unwrap(),
            "--num-workers",
            "2",
            "--restore",
        ];
        let c = PsConfig::from_args(args.iter().map(|s| s.to_string())).unwrap();
        assert_eq!(c.listen, "tcp://127.0.0.1:7000");
        assert_eq!(c.num_workers, 2);
        assert_eq!(c.mode, Mode::Async);
        assert_eq!(c.checkpoint_every, 5);
        assert!(c.restore);
        assert_eq!(c.sync_timeout, Duration::from_secs(30));
        assert_eq!(c.limits, Limits::default());
        assert_eq!(c.on_worker_loss, WorkerLoss::Fail);
        assert_eq!(c.keepalive, Some(DEFAULT_KEEPALIVE));
        let args = [
            "ibex-ps",
            "--listen",
            "tcp://127.0.0.1:7000",
            "--on-worker-loss",
            "continue",
            "--keepalive-secs",
            "0",
        ];
        let c = PsConfig::from_args(args.iter().map(|s| s.to_string())).unwrap();
        assert_eq!(c.on_worker_loss, WorkerLoss::Continue);
        assert_eq!(c.keepalive, None);
    }

    #[test]
    fn the_memory_budget_comes_from_a_flag_and_bad_sizes_are_named() {
        let args = |m: &str| {
            [
                "ibex-ps",
                "--listen",
                "tcp://127.0.0.1:7000",
                "--max-memory",
                m,
            ]
            .iter()
            .map(|s| s.to_string())
            .collect::<Vec<_>>()
        };
        let c = PsConfig::from_args(args("2G")).unwrap();
        assert_eq!(c.transport.max_memory, 2 << 30);
        let e = PsConfig::from_args(args("lots")).unwrap_err().to_string();
        assert!(e.contains("--max-memory") && e.contains("lots"), "{e}");
        let e = PsConfig::from_args(args("1M")).unwrap_err().to_string();
        assert!(e.contains("max_memory"), "{e}");
    }

    #[test]
    fn limits_come_from_flags_or_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("ps.toml");
        std::fs::write(
            &f,
            "listen = \"tcp://127.0.0.1:7000\"\nmax_variables = 7\nmax_bytes = 4096\n",
        )
        .unwrap();
        let args = [
            "ibex-ps",
            "--config",
            f.to_str().unwrap(),
            "--max-elements",
            "99",
        ];
        let c = PsConfig::from_args(args.iter().map(|s| s.to_string())).unwrap();
        assert_eq!(
            c.limits,
            Limits {
                max_variables: 7,
                max_elements: 99,
                max_bytes: 4096
            }
        );
    }

    #[test]
    fn the_connection_cap_comes_from_the_flag_or_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("ps.toml");
        std::fs::write(
            &f,
            "listen = \"tcp://127.0.0.1:7000\"\nmax_connections = 40\n",
        )
        .unwrap();
        let from_file = ["ibex-ps", "--config", f.to_str().unwrap()];
        let c = PsConfig::from_args(from_file.iter().map(|s| s.to_string())).unwrap();
        assert_eq!(c.transport.max_connections, Some(40));
        let flag = [
            "ibex-ps",
            "--config",
            f.to_str().unwrap(),
            "--max-connections",
            "9",
        ];
        let c = PsConfig::from_args(flag.iter().map(|s| s.to_string())).unwrap();
        assert_eq!(c.transport.max_connections, Some(9));
        let zero = ["ibex-ps", "--listen", "x", "--max-connections", "0"];
        let e = PsConfig::from_args(zero.iter().map(|s| s.to_string())).unwrap_err();
        assert!(e.to_string().contains("--max-connections"), "{e}");
    }

    #[test]
    fn bad_config_is_explained() {
        let e = PsConfig::from_args(["ibex-ps".to_string()]).unwrap_err();
        assert!(e.to_string().contains("--listen"), "{e}");
        let e = PsConfig::from_args(
            ["ibex-ps", "--listen", "x", "--mode", "fast"]
                .iter()
                .map(|s| s.to_string()),
        )
        .unwrap_err();
        assert!(e.to_string().contains("sync or async"), "{e}");
    }
}
