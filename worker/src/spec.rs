//! Who is in the job: the PS and worker task addresses and the transport between them,
//! read from a TOML file, from TensorFlow's `TF_CONFIG`, or from a Slurm allocation.
//!
//! Every task address is a `host:port`. Over shm the port only names the socket
//! ([`ibex_transport::conn::auto_shm_path`]), so one spec works for both shm and tcp.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;

/// How workers reach the parameter servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportKind {
    /// Ibex over shared memory (same host only).
    #[default]
    Shm,
    /// Ibex over TCP.
    Tcp,
    /// Ibex over RDMA verbs (needs the verbs provider and a device).
    Verbs,
    /// Stock tonic: HTTP/2 over TCP, the baseline Ibex replaces.
    Grpc,
}

impl TransportKind {
    /// The name used on command lines and in spec files.
    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::Shm => "shm",
            TransportKind::Tcp => "tcp",
            TransportKind::Verbs => "verbs",
            TransportKind::Grpc => "grpc",
        }
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TransportKind {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "shm" => Ok(TransportKind::Shm),
            "tcp" => Ok(TransportKind::Tcp),
            "verbs" => Ok(TransportKind::Verbs),
            "grpc" => Ok(TransportKind::Grpc),
            _ => Err(SpecError::Invalid(format!(
                "unknown transport {s:?}: use shm, tcp, verbs or grpc"
            ))),
        }
    }
}

/// The role of one task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobKind {
    /// A parameter-server shard.
    Ps,
    /// A training worker.
    Worker,
}

impl fmt::Display for JobKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            JobKind::Ps => "ps",
            JobKind::Worker => "worker",
        })
    }
}

impl FromStr for JobKind {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "ps" => Ok(JobKind::Ps),
            "worker" => Ok(JobKind::Worker),
            _ => Err(SpecError::Invalid(format!(
                "unknown job {s:?}: use ps or worker"
            ))),
        }
    }
}

/// Why a cluster spec could not be built. Each message says what to fix.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// The spec file could not be read.
    #[error("cannot read cluster spec {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// TOML syntax or a field of the wrong type.
    #[error(
        "cluster spec is not valid TOML: {0} (expected [cluster] ps = [\"host:port\", ..] workers = [..] transport = \"shm\")"
    )]
    Toml(String),
    /// TF_CONFIG is not the expected JSON.
    #[error(
        "TF_CONFIG is not valid: {0} (expected {{\"cluster\":{{\"ps\":[..],\"worker\":[..]}},\"task\":{{\"type\":\"worker\",\"index\":0}}}})"
    )]
    TfConfig(String),
    /// A Slurm variable is missing or malformed.
    #[error("Slurm environment: {0}")]
    Slurm(String),
    /// The content parsed but does not describe a usable job.
    #[error("invalid cluster spec: {0}")]
    Invalid(String),
}

/// The PS's sync timeout when nothing says otherwise (`ibex-ps --sync-timeout-secs`).
pub const DEFAULT_SYNC_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a call may outlive the PS's sync timeout: a sync push or pull legitimately
/// waits that long for the other workers, and the PS's own error, which names the workers
/// that are missing, must reach the caller before the call's deadline cuts it off.
pub const CALL_MARGIN: Duration = Duration::from_secs(10);

/// How long a worker waits for the PS, each bound settable. Nothing a worker does waits
/// without one of these: a PS that never answers costs at most a deadline, and one that
/// vanished is noticed by the keep-alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// The PS's sync timeout, which the defaults of the others follow: `ibex launch` gives
    /// it to the PS tasks it starts from this spec. Spec key `sync_timeout_secs`.
    pub sync: Duration,
    /// How long [`crate::Worker::connect`] keeps trying to reach each PS (one that is
    /// still starting is retried). Spec key `connect_timeout_secs`.
    pub connect: Duration,
    /// The deadline of every call to a PS, sent to it as `grpc-timeout` and enforced on
    /// the worker too. Spec key `call_timeout_secs`.
    pub call: Duration,
    /// Ping a PS connection after this long without hearing from it; `None` turns pings
    /// off. Spec key `keepalive_secs` (0: off).
    pub keepalive: Option<Duration>,
    /// Close the connection (its calls fail `Unavailable`) when a ping goes unanswered
    /// this long. Spec key `keepalive_timeout_secs`.
    pub keepalive_timeout: Duration,
}

impl Timeouts {
    /// The bounds that go with a PS sync timeout of `sync`: connecting may take as long as
    /// a step may wait, and a call that long plus [`CALL_MARGIN`]. A dead peer is seen
    /// within 8 s (a ping after 3 s of silence, 5 s for its answer) whatever the sync
    /// timeout: a PS busy with a long step still answers pings, since its connection's
    /// reader, not the step, answers them.
    pub fn following(sync: Duration) -> Timeouts {
        Timeouts {
            sync,
            connect: sync,
            call: sync.saturating_add(CALL_MARGIN),
            keepalive: Some(Duration::from_secs(3)),
            keepalive_timeout: Duration::from_secs(5),
        }
    }

    fn check(&self) -> Result<(), SpecError> {
        let bad = |key: &str| {
            SpecError::Invalid(format!(
                "{key} must be above zero: it bounds how long a worker waits for the PS"
            ))
        };
        if self.sync.is_zero() {
            return Err(bad("sync_timeout_secs"));
        }
        if self.connect.is_zero() {
            return Err(bad("connect_timeout_secs"));
        }
        if self.call.is_zero() {
            return Err(bad("call_timeout_secs"));
        }
        if self.keepalive_timeout.is_zero() {
            return Err(bad("keepalive_timeout_secs"));
        }
        Ok(())
    }
}

impl Default for Timeouts {
    /// [`Timeouts::following`] the PS's default sync timeout.
    fn default() -> Self {
        Timeouts::following(DEFAULT_SYNC_TIMEOUT)
    }
}

/// Seconds as written in a spec (fractions allowed), checked.
fn secs(key: &str, v: f64) -> Result<Duration, SpecError> {
    Duration::try_from_secs_f64(v).map_err(|_| {
        SpecError::Invalid(format!(
            "{key} = {v} is not a number of seconds (examples: 10, 0.5)"
        ))
    })
}

/// The tasks of a training job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSpec {
    /// Parameter-server task addresses, `host:port`, in shard order.
    pub ps: Vec<String>,
    /// Worker task addresses, `host:port`, in worker-index order.
    pub workers: Vec<String>,
    /// How workers reach the PS.
    pub transport: TransportKind,
    /// How long workers wait for the PS (default: [`Timeouts::default`]).
    pub timeouts: Timeouts,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TomlFile {
    cluster: TomlCluster,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TomlCluster {
    ps: Vec<String>,
    workers: Vec<String>,
    transport: Option<String>,
    sync_timeout_secs: Option<f64>,
    connect_timeout_secs: Option<f64>,
    call_timeout_secs: Option<f64>,
    keepalive_secs: Option<f64>,
    keepalive_timeout_secs: Option<f64>,
}

#[derive(Deserialize)]
struct TfConfig {
    cluster: HashMap<String, Vec<String>>,
    task: TfTask,
}

#[derive(Deserialize)]
struct TfTask {
    #[serde(rename = "type")]
    kind: String,
    index: usize,
}

impl ClusterSpec {
    /// Builds a spec, checking that every address is a `host:port` and that there is at
    /// least one PS and one worker.
    pub fn new(
        ps: Vec<String>,
        workers: Vec<String>,
        transport: TransportKind,
    ) -> Result<ClusterSpec, SpecError> {
        if ps.is_empty() {
            return Err(SpecError::Invalid(
                "no ps tasks: list at least one \"host:port\"".into(),
            ));
        }
        if workers.is_empty() {
            return Err(SpecError::Invalid(
                "no worker tasks: list at least one \"host:port\"".into(),
            ));
        }
        for a in ps.iter().chain(&workers) {
            split_host_port(a)?;
        }
        let mut seen = std::collections::HashSet::new();
        for a in &ps {
            if !seen.insert(a) {
                return Err(SpecError::Invalid(format!(
                    "ps address {a} is listed twice; each shard needs its own port"
                )));
            }
        }
        Ok(ClusterSpec {
            ps,
            workers,
            transport,
            timeouts: Timeouts::default(),
        })
    }

    /// The same spec with other [`Timeouts`], checked (each must be above zero).
    pub fn with_timeouts(mut self, timeouts: Timeouts) -> Result<ClusterSpec, SpecError> {
        timeouts.check()?;
        self.timeouts = timeouts;
        Ok(self)
    }

    /// Parses `[cluster] ps = [..] workers = [..] transport = "shm"` (transport defaults to
    /// shm), with optional `sync_timeout_secs` (the PS's, which the other bounds follow),
    /// `connect_timeout_secs`, `call_timeout_secs`, `keepalive_secs` (0: off) and
    /// `keepalive_timeout_secs`; see [`Timeouts`].
    pub fn from_toml_str(s: &str) -> Result<ClusterSpec, SpecError> {
        let f: TomlFile =
            toml::from_str(s).map_err(|e| SpecError::Toml(e.message().to_string()))?;
        let c = f.cluster;
        let transport = match c.transport {
            Some(t) => t.parse()?,
            None => TransportKind::Shm,
        };
        let mut t = match c.sync_timeout_secs {
            Some(v) => Timeouts::following(secs("sync_timeout_secs", v)?),
            None => Timeouts::default(),
        };
        if let Some(v) = c.connect_timeout_secs {
            t.connect = secs("connect_timeout_secs", v)?;
        }
        if let Some(v) = c.call_timeout_secs {
            t.call = secs("call_timeout_secs", v)?;
        }
        if let Some(v) = c.keepalive_secs {
            t.keepalive = Some(secs("keepalive_secs", v)?).filter(|k| !k.is_zero());
        }
        if let Some(v) = c.keepalive_timeout_secs {
            t.keepalive_timeout = secs("keepalive_timeout_secs", v)?;
        }
        ClusterSpec::new(c.ps, c.workers, transport)?.with_timeouts(t)
    }

    /// Reads and parses a TOML spec file.
    pub fn from_toml_file(p: &Path) -> Result<ClusterSpec, SpecError> {
        let s = std::fs::read_to_string(p).map_err(|source| SpecError::Io {
            path: p.to_path_buf(),
            source,
        })?;
        ClusterSpec::from_toml_str(&s)
    }

    /// The spec as TOML that [`ClusterSpec::from_toml_str`] reads back.
    pub fn to_toml(&self) -> String {
        let list = |v: &[String]| {
            v.iter()
                .map(|a| format!("{a:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let t = &self.timeouts;
        format!(
            "[cluster]\nps = [{}]\nworkers = [{}]\ntransport = \"{}\"\n\
             sync_timeout_secs = {:?}\nconnect_timeout_secs = {:?}\ncall_timeout_secs = {:?}\n\
             keepalive_secs = {:?}\nkeepalive_timeout_secs = {:?}\n",
            list(&self.ps),
            list(&self.workers),
            self.transport,
            t.sync.as_secs_f64(),
            t.connect.as_secs_f64(),
            t.call.as_secs_f64(),
            t.keepalive.map_or(0.0, |k| k.as_secs_f64()),
            t.keepalive_timeout.as_secs_f64(),
        )
    }

    /// TF_CONFIG JSON `{"cluster":{"ps":[..],"worker":[..]},"task":{"type":"ps"|"worker","index":i}}`.
    /// A `chief` task counts as worker 0 (the other workers follow it), as in TensorFlow.
    /// The transport is `$IBEX_TRANSPORT`, else tcp (TF_CONFIG jobs usually span hosts).
    pub fn from_tf_config(json: &str) -> Result<(ClusterSpec, JobKind, usize), SpecError> {
        from_tf_config_with(json, transport_from_env()?)
    }

    /// From a Slurm step (`srun`): `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_JOB_NODELIST` (or
    /// `SLURM_NODELIST`) and `SLURM_TASKS_PER_NODE` (block distribution). The first
    /// `IBEX_NUM_PS` ranks (default 1) are PS, the rest workers; rank `r` listens on port
    /// `IBEX_BASE_PORT + r` (default base 7470) of its node. Transport: `$IBEX_TRANSPORT`, else tcp.
    pub fn from_slurm_env() -> Result<(ClusterSpec, JobKind, usize), SpecError> {
        let get = |k: &str| std::env::var(k).ok();
        from_slurm_vars(&get, transport_from_env()?)
    }

    /// The URI a client uses for PS `i` over `self.transport`: shm ->
    /// `shm://<auto_shm_path(port)>`, tcp -> `tcp://host:port`, verbs -> `verbs://host:port`,
    /// grpc -> `http://host:port`.
    ///
    /// # Panics
    /// If `i >= self.ps.len()` (a caller bug, not bad input: shard indices come from the spec).
    pub fn ps_uri(&self, i: usize) -> String {
        self.uri_for(&self.ps[i], None)
    }

    /// What PS `i` listens on: like [`ClusterSpec::ps_uri`] with the host replaced by
    /// `0.0.0.0` so that other hosts can reach it (shm paths are unchanged).
    ///
    /// # Panics
    /// If `i >= self.ps.len()`.
    pub fn ps_listen_uri(&self, i: usize) -> String {
        self.uri_for(&self.ps[i], Some("0.0.0.0"))
    }

    fn uri_for(&self, addr: &str, bind: Option<&str>) -> String {
        // Addresses were validated in `new`; a hand-built spec with a bad one yields a URI
        // the transport rejects with its own clear error.
        let (host, port) = split_host_port(addr).unwrap_or((addr, 0));
        let host = bind.unwrap_or(host);
        match self.transport {
            TransportKind::Shm => format!("shm://{}", shm_socket(port).display()),
            TransportKind::Tcp => format!("tcp://{host}:{port}"),
            TransportKind::Verbs => format!("verbs://{host}:{port}"),
            TransportKind::Grpc => format!("http://{host}:{port}"),
        }
    }
}

/// `count` distinct TCP ports on `host` that were free a moment ago, for jobs whose tasks
/// all run here (the demo, tests).
///
/// A port is bound and released, so another process could take it before its task binds;
/// that window is accepted. Within this process no port is handed out twice: the kernel
/// readily gives a just-released port to the next `bind(0)`, and two tasks told the same
/// port (a shard and its metrics endpoint, say) would fail with "address in use".
pub fn free_ports(host: &str, count: usize) -> std::io::Result<Vec<u16>> {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    // Hold every listener until all are picked, so this call's ports differ too.
    let mut held = Vec::with_capacity(count);
    let mut ports = Vec::with_capacity(count);
    let mut tries = 0;
    while ports.len() < count {
        tries += 1;
        if tries > 64 * (count + 1) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!("no port on {host} that this process has not handed out already"),
            ));
        }
        let l = std::net::TcpListener::bind((host, 0))?;
        let p = l.local_addr()?.port();
        held.push(l);
        if !given.contains(&p) {
            given.push(p);
            ports.push(p);
        }
    }
    Ok(ports)
}

/// The transport settings of a task of this job: the `IBEX_*` variables its environment
/// sets ([`ibex_transport::Config::from_env`]), read here with the rest of the job's
/// environment. Binaries pass what this returns to [`crate::Worker::connect`].
pub fn transport_config() -> Result<ibex_transport::Config, SpecError> {
    ibex_transport::Config::from_env().map_err(|e| SpecError::Invalid(e.to_string()))
}

/// The shm socket of the task listening on `port`: in the directory the job's environment
/// names (`IBEX_SHM_DIR`, else `XDG_RUNTIME_DIR`), as [`transport_config`] reads it, so that
/// the PS's listener and its workers agree on it.
fn shm_socket(port: u16) -> PathBuf {
    let dir = ibex_transport::config::env_shm_dir()
        .unwrap_or_else(|| ibex_transport::Config::default().shm_dir);
    ibex_transport::conn::auto_shm_path(&dir, port)
}

fn transport_from_env() -> Result<TransportKind, SpecError> {
    match std::env::var("IBEX_TRANSPORT") {
        Ok(t) if !t.trim().is_empty() => t.parse(),
        _ => Ok(TransportKind::Tcp),
    }
}

fn split_host_port(a: &str) -> Result<(&str, u16), SpecError> {
    let bad =
        |why: &str| SpecError::Invalid(format!("task address {a:?}: {why}; expected host:port"));
    let (host, port) = a.rsplit_once(':').ok_or_else(|| bad("no port"))?;
    if host.is_empty() {
        return Err(bad("empty host"));
    }
    let port = port
        .parse::<u16>()
        .map_err(|_| bad("port is not a number in 1..=65535"))?;
    if port == 0 {
        return Err(bad("port 0 cannot be dialled"));
    }
    Ok((host, port))
}

fn from_tf_config_with(
    json: &str,
    transport: TransportKind,
) -> Result<(ClusterSpec, JobKind, usize), SpecError> {
    let tf: TfConfig =
        serde_json::from_str(json).map_err(|e| SpecError::TfConfig(e.to_string()))?;
    let take = |k: &str| tf.cluster.get(k).cloned().unwrap_or_default();
    let ps = take("ps");
    let chief = take("chief");
    if chief.len() > 1 {
        return Err(SpecError::TfConfig(format!(
            "{} chief tasks; TensorFlow allows one",
            chief.len()
        )));
    }
    let mut workers = chief.clone();
    workers.extend(take("worker"));
    let (job, index) = match tf.task.kind.as_str() {
        "ps" => (JobKind::Ps, tf.task.index),
        "chief" => (JobKind::Worker, tf.task.index),
        "worker" => (JobKind::Worker, tf.task.index + chief.len()),
        other => {
            return Err(SpecError::TfConfig(format!(
                "task type {other:?}: Ibex runs ps, worker and chief tasks"
            )));
        }
    };
    let spec =
        ClusterSpec::new(ps, workers, transport).map_err(|e| SpecError::TfConfig(e.to_string()))?;
    let n = if job == JobKind::Ps {
        spec.ps.len()
    } else {
        spec.workers.len()
    };
    if index >= n {
        return Err(SpecError::TfConfig(format!(
            "task {} index {} is out of range: the cluster lists {n} such tasks",
            tf.task.kind, tf.task.index
        )));
    }
    Ok((spec, job, index))
}

fn from_slurm_vars(
    get: &dyn Fn(&str) -> Option<String>,
    transport: TransportKind,
) -> Result<(ClusterSpec, JobKind, usize), SpecError> {
    let num = |k: &str, default: Option<usize>| -> Result<usize, SpecError> {
        match get(k) {
            Some(v) => v
                .trim()
                .parse::<usize>()
                .map_err(|_| SpecError::Slurm(format!("{k}={v:?} is not a non-negative integer"))),
            None => default.ok_or_else(|| {
                SpecError::Slurm(format!("{k} is not set: run the task under srun"))
            }),
        }
    };
    let rank = num("SLURM_PROCID", None)?;
    let ntasks = num("SLURM_NTASKS", None)?;
    let num_ps = num("IBEX_NUM_PS", Some(1))?;
    let base = num("IBEX_BASE_PORT", Some(7470))?;
    let nodelist = get("SLURM_JOB_NODELIST")
        .or_else(|| get("SLURM_NODELIST"))
        .ok_or_else(|| {
            SpecError::Slurm("SLURM_JOB_NODELIST is not set: run the task under srun".into())
        })?;
    let nodes = expand_nodelist(&nodelist)?;
    if rank >= ntasks {
        return Err(SpecError::Slurm(format!(
            "SLURM_PROCID={rank} is not below SLURM_NTASKS={ntasks}"
        )));
    }
    if num_ps == 0 || num_ps >= ntasks {
        return Err(SpecError::Slurm(format!(
            "IBEX_NUM_PS={num_ps} with {ntasks} tasks leaves no PS or no worker: ask srun for more tasks (-n)"
        )));
    }
    if base + ntasks > 65536 || base == 0 {
        return Err(SpecError::Slurm(format!(
            "IBEX_BASE_PORT={base} + {ntasks} tasks runs past port 65535"
        )));
    }
    let per_node = match get("SLURM_TASKS_PER_NODE") {
        Some(s) => parse_tasks_per_node(&s)?,
        None => {
            // Without the layout, assume srun's default block distribution, as even as possible.
            let n = nodes.len();
            (0..n)
                .map(|i| ntasks / n + usize::from(i < ntasks % n))
                .collect()
        }
    };
    if per_node.len() != nodes.len() {
        return Err(SpecError::Slurm(format!(
            "SLURM_TASKS_PER_NODE describes {} nodes but the nodelist has {}",
            per_node.len(),
            nodes.len()
        )));
    }
    let mut host_of_rank = Vec::with_capacity(ntasks);
    for (node, &count) in nodes.iter().zip(&per_node) {
        host_of_rank.extend(std::iter::repeat_n(node.as_str(), count));
    }
    if host_of_rank.len() < ntasks {
        return Err(SpecError::Slurm(format!(
            "the nodes hold {} tasks but SLURM_NTASKS={ntasks}",
            host_of_rank.len()
        )));
    }
    let addrs: Vec<String> = (0..ntasks)
        .map(|r| format!("{}:{}", host_of_rank[r], base + r))
        .collect();
    let spec = ClusterSpec::new(
        addrs[..num_ps].to_vec(),
        addrs[num_ps..].to_vec(),
        transport,
    )?;
    let (job, index) = if rank < num_ps {
        (JobKind::Ps, rank)
    } else {
        (JobKind::Worker, rank - num_ps)
    };
    Ok((spec, job, index))
}

/// `SLURM_TASKS_PER_NODE`: `2(x3),1` means three nodes with 2 tasks, then one with 1.
fn parse_tasks_per_node(s: &str) -> Result<Vec<usize>, SpecError> {
    let bad = || {
        SpecError::Slurm(format!(
            "SLURM_TASKS_PER_NODE={s:?} is not like \"2(x3),1\""
        ))
    };
    let mut out = Vec::new();
    for part in s.split(',') {
        let part = part.trim();
        let (n, times) = match part.split_once("(x") {
            Some((n, rest)) => (
                n,
                rest.strip_suffix(')')
                    .ok_or_else(bad)?
                    .parse::<usize>()
                    .map_err(|_| bad())?,
            ),
            None => (part, 1),
        };
        let n = n.parse::<usize>().map_err(|_| bad())?;
        out.extend(std::iter::repeat_n(n, times));
    }
    Ok(out)
}

/// Expands a Slurm hostlist: `node[01-03,07],gpu5` -> node01 node02 node03 node07 gpu5.
/// Several bracket groups in one name (`r[1-2]n[1-2]`) expand as a product; zero padding
/// follows the lower bound of each range.
pub fn expand_nodelist(s: &str) -> Result<Vec<String>, SpecError> {
    let mut out = Vec::new();
    for name in split_top_level(s)? {
        if name.is_empty() {
            return Err(SpecError::Slurm(format!(
                "nodelist {s:?} has an empty entry"
            )));
        }
        expand_name(&name, s, &mut out)?;
    }
    if out.is_empty() {
        return Err(SpecError::Slurm("the nodelist is empty".into()));
    }
    Ok(out)
}

fn split_top_level(s: &str) -> Result<Vec<String>, SpecError> {
    let mut parts = Vec::new();
    let mut depth = 0usize;
    let mut cur = String::new();
    for c in s.trim().chars() {
        match c {
            '[' => depth += 1,
            ']' => {
                depth = depth.checked_sub(1).ok_or_else(|| {
                    SpecError::Slurm(format!("nodelist {s:?} has an unmatched ']'"))
                })?
            }
            ',' if depth == 0 => {
                parts.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    if depth != 0 {
        return Err(SpecError::Slurm(format!(
            "nodelist {s:?} has an unmatched '['"
        )));
    }
    parts.push(cur);
    Ok(parts)
}

fn expand_name(name: &str, whole: &str, out: &mut Vec<String>) -> Result<(), SpecError> {
    let bad = |why: &str| SpecError::Slurm(format!("nodelist {whole:?}: {why}"));
    let Some(open) = name.find('[') else {
        out.push(name.to_string());
        return Ok(());
    };
    let close = name[open..]
        .find(']')
        .map(|c| open + c)
        .ok_or_else(|| bad("unmatched '['"))?;
    let (prefix, ranges, rest) = (&name[..open], &name[open + 1..close], &name[close + 1..]);
    let mut tails = Vec::new();
    expand_name(rest, whole, &mut tails)?;
    for r in ranges.split(',') {
        let (lo, hi) = r.split_once('-').unwrap_or((r, r));
        let width = lo.len();
        let lo_n: u64 = lo
            .parse()
            .map_err(|_| bad(&format!("range {r:?} is not digits")))?;
        let hi_n: u64 = hi
            .parse()
            .map_err(|_| bad(&format!("range {r:?} is not digits")))?;
        if hi_n < lo_n {
            return Err(bad(&format!("range {r:?} runs backwards")));
        }
        if hi_n - lo_n > 100_000 {
            return Err(bad(&format!("range {r:?} is implausibly large")));
        }
        for n in lo_n..=hi_n {
            for t in &tails {
                out.push(format!("{prefix}{n:0width$}{t}"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_never_handed_out_twice_in_a_process() {
        // One at a time, as tests ask for them: the kernel often returns a just-released
        // port to the next bind(0), which once gave a shard and its metrics the same port.
        let mut all: Vec<u16> = (0..50)
            .map(|_| free_ports("127.0.0.1", 1).unwrap()[0])
            .collect();
        all.extend(free_ports("127.0.0.1", 20).unwrap());
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n, "a port was handed out twice");
        assert!(all.iter().all(|&p| p != 0));
    }

    #[test]
    fn toml_round_trip_and_default_transport() {
        let s = ClusterSpec::from_toml_str(
            "[cluster]\nps = [\"a:1000\", \"b:1001\"]\nworkers = [\"c:2000\"]\n",
        )
        .unwrap();
        assert_eq!(s.ps, vec!["a:1000", "b:1001"]);
        assert_eq!(s.workers, vec!["c:2000"]);
        assert_eq!(s.transport, TransportKind::Shm);
        let t = ClusterSpec {
            transport: TransportKind::Grpc,
            ..s.clone()
        };
        assert_eq!(ClusterSpec::from_toml_str(&t.to_toml()).unwrap(), t);
    }

    #[test]
    fn timeouts_follow_the_sync_timeout_unless_set() {
        let base = "[cluster]\nps = [\"a:1000\"]\nworkers = [\"c:2000\"]\n";
        let s = ClusterSpec::from_toml_str(base).unwrap();
        assert_eq!(s.timeouts, Timeouts::default());
        assert_eq!(s.timeouts.connect, DEFAULT_SYNC_TIMEOUT);
        assert_eq!(s.timeouts.call, DEFAULT_SYNC_TIMEOUT + CALL_MARGIN);
        let s = ClusterSpec::from_toml_str(&format!("{base}sync_timeout_secs = 4\n")).unwrap();
        assert_eq!(s.timeouts.connect, Duration::from_secs(4));
        assert_eq!(s.timeouts.call, Duration::from_secs(14));
        let s = ClusterSpec::from_toml_str(&format!(
            "{base}sync_timeout_secs = 4\ncall_timeout_secs = 0.5\nkeepalive_secs = 0\n"
        ))
        .unwrap();
        assert_eq!(s.timeouts.call, Duration::from_millis(500));
        assert_eq!(s.timeouts.connect, Duration::from_secs(4));
        assert_eq!(s.timeouts.keepalive, None);
        assert_eq!(ClusterSpec::from_toml_str(&s.to_toml()).unwrap(), s);
        let e = ClusterSpec::from_toml_str(&format!("{base}call_timeout_secs = 0\n")).unwrap_err();
        assert!(e.to_string().contains("call_timeout_secs"), "{e}");
        let e =
            ClusterSpec::from_toml_str(&format!("{base}connect_timeout_secs = -1\n")).unwrap_err();
        assert!(e.to_string().contains("connect_timeout_secs"), "{e}");
    }

    #[test]
    fn toml_errors_name_the_problem() {
        let e =
            ClusterSpec::from_toml_str("[cluster]\nps = []\nworkers = [\"c:1\"]\n").unwrap_err();
        assert!(e.to_string().contains("no ps tasks"), "{e}");
        let e = ClusterSpec::from_toml_str("[cluster]\nps = [\"a\"]\nworkers = [\"c:1\"]\n")
            .unwrap_err();
        assert!(e.to_string().contains("\"a\""), "{e}");
        let e = ClusterSpec::from_toml_str(
            "[cluster]\nps = [\"a:1\"]\nworkers = [\"c:1\"]\ntransport = \"ib\"\n",
        )
        .unwrap_err();
        assert!(e.to_string().contains("unknown transport"), "{e}");
        let e = ClusterSpec::from_toml_str("[cluster]\nps = [\"a:1\"]\nworker = [\"c:1\"]\n")
            .unwrap_err();
        assert!(matches!(e, SpecError::Toml(_)), "{e}");
        let e =
            ClusterSpec::from_toml_str("[cluster]\nps = [\"a:1\", \"a:1\"]\nworkers = [\"c:1\"]\n")
                .unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");
        let e = ClusterSpec::from_toml_file(Path::new("/nonexistent/cluster.toml")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/cluster.toml"), "{e}");
    }

    #[test]
    fn uris_per_transport() {
        let mut s = ClusterSpec::new(
            vec!["h1:7000".into()],
            vec!["h2:7001".into()],
            TransportKind::Tcp,
        )
        .unwrap();
        assert_eq!(s.ps_uri(0), "tcp://h1:7000");
        assert_eq!(s.ps_listen_uri(0), "tcp://0.0.0.0:7000");
        s.transport = TransportKind::Verbs;
        assert_eq!(s.ps_uri(0), "verbs://h1:7000");
        s.transport = TransportKind::Grpc;
        assert_eq!(s.ps_uri(0), "http://h1:7000");
        assert_eq!(s.ps_listen_uri(0), "http://0.0.0.0:7000");
        s.transport = TransportKind::Shm;
        let want = format!("shm://{}", shm_socket(7000).display());
        assert_eq!(s.ps_uri(0), want);
        assert_eq!(s.ps_listen_uri(0), want);
    }

    #[test]
    fn tf_config_ps_worker_and_chief() {
        let j = r#"{"cluster":{"ps":["p0:1","p1:2"],"worker":["w0:3","w1:4"]},"task":{"type":"worker","index":1}}"#;
        let (s, job, i) = from_tf_config_with(j, TransportKind::Tcp).unwrap();
        assert_eq!(
            (s.ps.len(), s.workers.len(), job, i),
            (2, 2, JobKind::Worker, 1)
        );
        assert_eq!(s.workers[1], "w1:4");
        let j = r#"{"cluster":{"ps":["p0:1"],"chief":["c:9"],"worker":["w0:3"]},"task":{"type":"worker","index":0}}"#;
        let (s, job, i) = from_tf_config_with(j, TransportKind::Tcp).unwrap();
        assert_eq!(s.workers, vec!["c:9", "w0:3"]);
        assert_eq!((job, i), (JobKind::Worker, 1));
        let j = r#"{"cluster":{"ps":["p0:1"],"worker":["w0:3"]},"task":{"type":"ps","index":0}}"#;
        assert_eq!(
            from_tf_config_with(j, TransportKind::Shm).unwrap().1,
            JobKind::Ps
        );
    }

    #[test]
    fn tf_config_errors() {
        let j = r#"{"cluster":{"ps":["p0:1"],"worker":["w0:3"]},"task":{"type":"ps","index":1}}"#;
        let e = from_tf_config_with(j, TransportKind::Tcp).unwrap_err();
        assert!(e.to_string().contains("out of range"), "{e}");
        let j = r#"{"cluster":{"ps":["p0:1"],"worker":["w0:3"]},"task":{"type":"evaluator","index":0}}"#;
        assert!(
            from_tf_config_with(j, TransportKind::Tcp)
                .unwrap_err()
                .to_string()
                .contains("evaluator")
        );
        assert!(matches!(
            from_tf_config_with("{", TransportKind::Tcp),
            Err(SpecError::TfConfig(_))
        ));
    }

    #[test]
    fn nodelist_expansion() {
        assert_eq!(
            expand_nodelist("node[01-03,07]").unwrap(),
            vec!["node01", "node02", "node03", "node07"]
        );
        assert_eq!(
            expand_nodelist("a,b[8-10],c").unwrap(),
            vec!["a", "b8", "b9", "b10", "c"]
        );
        assert_eq!(
            expand_nodelist("r[1-2]n[1-2]").unwrap(),
            vec!["r1n1", "r1n2", "r2n1", "r2n2"]
        );
        assert_eq!(
            expand_nodelist("gpu-[009-011]").unwrap(),
            vec!["gpu-009", "gpu-010", "gpu-011"]
        );
        for bad in ["node[01-03", "node]", "n[3-1]", "n[a-b]", "", "a,,b"] {
            assert!(
                matches!(expand_nodelist(bad), Err(SpecError::Slurm(_))),
                "{bad:?} should fail"
            );
        }
    }

    fn slurm(vars: &[(&str, &str)]) -> Result<(ClusterSpec, JobKind, usize), SpecError> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        from_slurm_vars(&|k: &str| m.get(k).cloned(), TransportKind::Tcp)
    }

    #[test]
    fn slurm_block_layout() {
        let base = [
            ("SLURM_NTASKS", "5"),
            ("SLURM_JOB_NODELIST", "n[1-3]"),
            ("SLURM_TASKS_PER_NODE", "2(x2),1"),
            ("IBEX_NUM_PS", "2"),
            ("IBEX_BASE_PORT", "9000"),
        ];
        let mut v = base.to_vec();
        v.push(("SLURM_PROCID", "1"));
        let (s, job, i) = slurm(&v).unwrap();
        assert_eq!(s.ps, vec!["n1:9000", "n1:9001"]);
        assert_eq!(s.workers, vec!["n2:9002", "n2:9003", "n3:9004"]);
        assert_eq!((job, i), (JobKind::Ps, 1));
        v[5] = ("SLURM_PROCID", "4");
        let (_, job, i) = slurm(&v).unwrap();
        assert_eq!((job, i), (JobKind::Worker, 2));
        // Without SLURM_TASKS_PER_NODE, an even block layout.
        let (s, _, _) = slurm(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "3"),
            ("SLURM_NODELIST", "a,b"),
        ])
        .unwrap();
        assert_eq!(s.ps, vec!["a:7470"]);
        assert_eq!(s.workers, vec!["a:7471", "b:7472"]);
    }

    #[test]
    fn slurm_errors() {
        let e = slurm(&[("SLURM_NTASKS", "2"), ("SLURM_JOB_NODELIST", "a")]).unwrap_err();
        assert!(e.to_string().contains("SLURM_PROCID is not set"), "{e}");
        let e = slurm(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_JOB_NODELIST", "a"),
        ])
        .unwrap_err();
        assert!(e.to_string().contains("no PS or no worker"), "{e}");
        let e = slurm(&[
            ("SLURM_PROCID", "x"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_JOB_NODELIST", "a"),
        ])
        .unwrap_err();
        assert!(e.to_string().contains("SLURM_PROCID=\"x\""), "{e}");
        let e = slurm(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_JOB_NODELIST", "a,b"),
            ("SLURM_TASKS_PER_NODE", "1(x2)"),
        ])
        .unwrap_err();
        assert!(e.to_string().contains("hold 2 tasks"), "{e}");
    }
}
