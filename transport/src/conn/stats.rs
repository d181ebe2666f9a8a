//! Per-connection statistics: the core's protocol counters plus what only the driver sees
//! (which provider and data path, how many payload bytes were copied or moved without a copy).

use std::fmt;

use crate::proto::ProtoStats;

/// A snapshot of one connection's counters.
#[derive(Debug, Clone, Default)]
pub struct ConnStats {
    /// Protocol counters (eager/rendezvous messages and bytes, coalescing, credit stalls,
    /// the eager threshold and how it was chosen).
    pub proto: ProtoStats,
    /// `"shm"`, `"tcp"` or `"verbs"`.
    pub provider: &'static str,
    /// How arbitrary rendezvous buffers move: `"cma"`, `"bounce"`, `"tcp-stream"`, `"rdma-read"`.
    pub rendezvous_path: String,
    /// Rendezvous payload bytes received by reads (one copy: CMA, bounce, stream or RDMA READ).
    pub rndv_read_bytes: u64,
    /// Rendezvous payload bytes received as a view of the peer's registered pool: no copy.
    pub rndv_mapped_bytes: u64,
    /// Rendezvous messages received as such views.
    pub rndv_mapped_msgs: u64,
    /// Rendezvous payload bytes sent from registered-pool buffers (no copy on a mapping peer).
    pub pool_bytes_sent: u64,
    /// Rendezvous messages received straight into a caller-provided buffer (`recv_into`).
    pub recv_into_direct: u64,
    /// Bytes moved by explicit one-sided reads (`read_remote`).
    pub remote_read_bytes: u64,
}

impl ConnStats {
    /// Payload bytes this side copied on receive: eager copies out of slots plus rendezvous
    /// reads. Pool views are not counted: they are never copied.
    pub fn payload_bytes_copied(&self) -> u64 {
        self.proto.eager_bytes_recv + self.rndv_read_bytes
    }
}

impl fmt::Display for ConnStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.proto;
        writeln!(
            f,
            "provider {} (rendezvous path: {})",
            self.provider, self.rendezvous_path
        )?;
        writeln!(
            f,
            "eager threshold {} B ({}), fragment {} B ({})",
            p.eager_threshold, p.threshold_source, p.fragment_size, p.fragment_source
        )?;
        writeln!(
            f,
            "sent:     eager {} msgs / {} B, rendezvous {} msgs / {} B ({} B from pool)",
            p.eager_msgs_sent,
            p.eager_bytes_sent,
            p.rndv_msgs_sent,
            p.rndv_bytes_sent,
            self.pool_bytes_sent
        )?;
        writeln!(
            f,
            "received: eager {} msgs / {} B, rendezvous {} msgs / {} B ({} B read, {} B mapped zero-copy)",
            p.eager_msgs_recv,
            p.eager_bytes_recv,
            p.rndv_msgs_recv,
            p.rndv_bytes_recv,
            self.rndv_read_bytes,
            self.rndv_mapped_bytes
        )?;
        write!(
            f,
            "coalesced {} msgs, credit stalls {}, frames {} out / {} in, reads {}",
            p.coalesced_msgs, p.credit_stalls, p.frames_sent, p.frames_recv, p.reads_issued
        )
    }
}
