//! Placeholder cluster spec with the agreed signatures; the demo developer's `spec.rs`
//! replaces this file.

use std::path::Path;
use std::str::FromStr;

/// How workers reach the parameter servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    /// Ibex over shared memory.
    Shm,
    /// Ibex over TCP.
    Tcp,
    /// Ibex over RDMA verbs.
    Verbs,
    /// Stock tonic (HTTP/2 over TCP).
    Grpc,
}

impl FromStr for TransportKind {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        match s {
            "shm" => Ok(TransportKind::Shm),
            "tcp" => Ok(TransportKind::Tcp),
            "verbs" => Ok(TransportKind::Verbs),
            "grpc" => Ok(TransportKind::Grpc),
            o => Err(SpecError(format!("unknown transport {o:?}: use shm, tcp, verbs or grpc"))),
        }
    }
}

/// The role of one task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobKind {
    /// A parameter server.
    Ps,
    /// A worker.
    Worker,
}

/// A bad cluster spec.
#[derive(Debug, thiserror::Error)]
#[error("cluster spec: {0}")]
pub struct SpecError(pub String);

/// The tasks of a training cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSpec {
    /// PS task addresses, "host:port".
    pub ps: Vec<String>,
    /// Worker task addresses, "host:port".
    pub workers: Vec<String>,
    /// How workers reach the PS.
    pub transport: TransportKind,
}

#[derive(serde::Deserialize)]
struct TomlFile {
    cluster: TomlCluster,
}

#[derive(serde::Deserialize)]
struct TomlCluster {
    ps: Vec<String>,
    #[serde(default)]
    workers: Vec<String>,
    #[serde(default)]
    transport: Option<String>,
}

impl ClusterSpec {
    /// Parses `[cluster] ps=[..] workers=[..] transport="shm"`.
    pub fn from_toml_str(s: &str) -> Result<ClusterSpec, SpecError> {
        let f: TomlFile = toml::from_str(s).map_err(|e| SpecError(e.to_string()))?;
        let transport = f.cluster.transport.as_deref().unwrap_or("shm").parse()?;
        Ok(ClusterSpec { ps: f.cluster.ps, workers: f.cluster.workers, transport })
    }

    /// Reads and parses a TOML file.
    pub fn from_toml_file(p: &Path) -> Result<ClusterSpec, SpecError> {
        let s = std::fs::read_to_string(p).map_err(|e| SpecError(format!("{}: {e}", p.display())))?;
        Self::from_toml_str(&s)
    }

    /// Parses TF_CONFIG JSON.
    pub fn from_tf_config(json: &str) -> Result<(ClusterSpec, JobKind, usize), SpecError> {
        let v: serde_json::Value = serde_json::from_str(json).map_err(|e| SpecError(e.to_string()))?;
        let list = |k: &str| -> Vec<String> {
            v["cluster"][k].as_array().map(|a| a.iter().filter_map(|x| x.as_str().map(String::from)).collect()).unwrap_or_default()
        };
        let job = match v["task"]["type"].as_str() {
            Some("ps") => JobKind::Ps,
            Some("worker") => JobKind::Worker,
            o => return Err(SpecError(format!("task.type {o:?} is not \"ps\" or \"worker\""))),
        };
        let index = v["task"]["index"].as_u64().ok_or_else(|| SpecError("task.index missing".into()))? as usize;
        Ok((ClusterSpec { ps: list("ps"), workers: list("worker"), transport: TransportKind::Shm }, job, index))
    }

    /// Reads SLURM_PROCID, SLURM_NTASKS, SLURM_JOB_NODELIST, IBEX_NUM_PS, IBEX_BASE_PORT.
    pub fn from_slurm_env() -> Result<(ClusterSpec, JobKind, usize), SpecError> {
        let var = |k: &str| std::env::var(k).map_err(|_| SpecError(format!("{k} is not set")));
        let num = |k: &str| -> Result<usize, SpecError> { var(k)?.parse().map_err(|_| SpecError(format!("{k} is not a number"))) };
        let rank = num("SLURM_PROCID")?;
        let ntasks = num("SLURM_NTASKS")?;
        let nps = num("IBEX_NUM_PS").unwrap_or(1);
        let base = num("IBEX_BASE_PORT").unwrap_or(5000);
        let host = var("SLURM_JOB_NODELIST")?.split(',').next().unwrap_or("localhost").to_string();
        let addrs: Vec<String> = (0..ntasks).map(|r| format!("{host}:{}", base + r)).collect();
        let spec = ClusterSpec { ps: addrs[..nps.min(ntasks)].to_vec(), workers: addrs[nps.min(ntasks)..].to_vec(), transport: TransportKind::Shm };
        Ok(if rank < nps { (spec, JobKind::Ps, rank) } else { (spec, JobKind::Worker, rank - nps) })
    }

    fn uri_for(&self, addr: &str) -> String {
        let port = addr.rsplit_once(':').and_then(|(_, p)| p.parse::<u16>().ok()).unwrap_or(0);
        match self.transport {
            TransportKind::Shm => format!("shm://{}", ibex_transport::conn::auto_shm_path(port).display()),
            TransportKind::Tcp => format!("tcp://{addr}"),
            TransportKind::Verbs => format!("verbs://{addr}"),
            TransportKind::Grpc => format!("http://{addr}"),
        }
    }

    /// The URI a client uses for PS `i`.
    pub fn ps_uri(&self, i: usize) -> String {
        self.uri_for(&self.ps[i])
    }

    /// What PS `i` listens on.
    pub fn ps_listen_uri(&self, i: usize) -> String {
        let port = self.ps[i].rsplit_once(':').map(|(_, p)| p).unwrap_or("0");
        self.uri_for(&format!("0.0.0.0:{port}"))
    }
}
