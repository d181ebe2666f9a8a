//! Per-connection statistics: the core's protocol counters plus what only the driver sees
//! (which provider and data path, how many payload bytes were copied or moved without a copy).

use std::fmt;

use crate::link::{PushStats, Registration};
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
    /// Buffers exposed to the peer (rendezvous sends and `expose`) that lay in the registered
    /// pool, so needed no registration.
    pub exposed_from_pool: u64,
    /// Exposed buffers that reused a cached memory registration (verbs).
    pub reg_cache_hits: u64,
    /// Exposed buffers that had to be registered (verbs): each costs a kernel call and pinning.
    pub reg_cache_misses: u64,
    /// Messages a waiting receiver read from the link on its own task (whoever waits,
    /// reads) rather than taking them from the driver task.
    pub inline_reads: u64,
    /// Copies of rendezvous reads that such a receiver ran itself, with the connection's
    /// lock released, rather than waking the driver task to run them (shm's large reads).
    pub inline_copies: u64,
    /// Message bodies pushed behind their RTS, both ways (tcp). Held and dropped pushes
    /// mean the receive budget deferred messages (`Config::rndv_recv_budget`).
    pub pushes: PushStats,
}

impl ConnStats {
    /// Counts one exposure's registration outcome.
    pub(crate) fn count_registration(&mut self, r: Registration) {
        match r {
            Registration::NotNeeded => {}
            Registration::Pool => self.exposed_from_pool += 1,
            Registration::CacheHit => self.reg_cache_hits += 1,
            Registration::Registered => self.reg_cache_misses += 1,
        }
    }

    /// Share of exposures that needed no new registration (pool or cache hit), over those that
    /// needed registered memory at all; `None` when none did (shm CMA and tcp register nothing).
    pub fn reg_cache_hit_rate(&self) -> Option<f64> {
        let hits = self.exposed_from_pool + self.reg_cache_hits;
        let all = hits + self.reg_cache_misses;
        (all > 0).then(|| hits as f64 / all as f64)
    }

    /// Adds `other`'s counters to these (for totals over many connections). Settings that are
    /// not counters (provider, path, threshold) keep this side's values when set.
    pub fn accumulate(&mut self, other: &ConnStats) {
        let (p, o) = (&mut self.proto, &other.proto);
        p.eager_msgs_sent += o.eager_msgs_sent;
        p.eager_bytes_sent += o.eager_bytes_sent;
        p.rndv_msgs_sent += o.rndv_msgs_sent;
        p.rndv_bytes_sent += o.rndv_bytes_sent;
        p.eager_msgs_recv += o.eager_msgs_recv;
        p.eager_bytes_recv += o.eager_bytes_recv;
        p.rndv_msgs_recv += o.rndv_msgs_recv;
        p.rndv_bytes_recv += o.rndv_bytes_recv;
        p.coalesced_msgs += o.coalesced_msgs;
        p.credit_stalls += o.credit_stalls;
        p.frames_sent += o.frames_sent;
        p.frames_recv += o.frames_recv;
        p.reads_issued += o.reads_issued;
        p.rndv_recv_deferred += o.rndv_recv_deferred;
        if self.provider.is_empty() {
            self.provider = other.provider;
            self.rendezvous_path = other.rendezvous_path.clone();
            p.eager_threshold = o.eager_threshold;
            p.threshold_source = o.threshold_source;
            p.fragment_size = o.fragment_size;
            p.fragment_source = o.fragment_source;
        }
        self.rndv_read_bytes += other.rndv_read_bytes;
        self.rndv_mapped_bytes += other.rndv_mapped_bytes;
        self.rndv_mapped_msgs += other.rndv_mapped_msgs;
        self.pool_bytes_sent += other.pool_bytes_sent;
        self.recv_into_direct += other.recv_into_direct;
        self.remote_read_bytes += other.remote_read_bytes;
        self.exposed_from_pool += other.exposed_from_pool;
        self.reg_cache_hits += other.reg_cache_hits;
        self.reg_cache_misses += other.reg_cache_misses;
        self.inline_reads += other.inline_reads;
        self.inline_copies += other.inline_copies;
        self.pushes.accumulate(&other.pushes);
    }

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
        )?;
        if p.rndv_recv_deferred > 0 {
            write!(
                f,
                ", {} receives waited for the receive budget",
                p.rndv_recv_deferred
            )?;
        }
        let q = &self.pushes;
        if *q != PushStats::default() {
            write!(
                f,
                "\npushed: {} sent; received {} straight into their reads, {} held, {} dropped, {} reads asked",
                q.sent, q.direct, q.held, q.dropped, q.asked
            )?;
        }
        if let Some(rate) = self.reg_cache_hit_rate() {
            write!(
                f,
                "\nexposed: {} from the pool, {} registration-cache hits, {} new registrations (hit rate {:.1}%)",
                self.exposed_from_pool,
                self.reg_cache_hits,
                self.reg_cache_misses,
                rate * 100.0
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hit_rate_counts_pool_and_cache_hits_against_new_registrations() {
        let mut s = ConnStats::default();
        assert_eq!(s.reg_cache_hit_rate(), None);
        s.count_registration(Registration::NotNeeded);
        assert_eq!(
            s.reg_cache_hit_rate(),
            None,
            "CMA/tcp exposures register nothing"
        );
        s.count_registration(Registration::Registered);
        s.count_registration(Registration::CacheHit);
        s.count_registration(Registration::CacheHit);
        s.count_registration(Registration::Pool);
        assert_eq!(s.reg_cache_hit_rate(), Some(0.75));
        assert!(s.to_string().contains("hit rate 75.0%"), "{s}");
    }

    #[test]
    fn totals_sum_counters_and_keep_the_first_settings() {
        let mut a = ConnStats {
            provider: "verbs",
            rendezvous_path: "rdma-read".into(),
            reg_cache_hits: 2,
            ..Default::default()
        };
        a.proto.eager_msgs_sent = 5;
        a.proto.eager_threshold = 8192;
        let mut b = ConnStats {
            provider: "verbs",
            reg_cache_misses: 1,
            remote_read_bytes: 10,
            inline_reads: 3,
            inline_copies: 4,
            pushes: PushStats {
                sent: 5,
                held: 1,
                ..Default::default()
            },
            ..Default::default()
        };
        b.proto.eager_msgs_sent = 7;
        b.proto.eager_threshold = 4096;
        let mut total = ConnStats::default();
        total.accumulate(&a);
        total.accumulate(&b);
        assert_eq!(total.proto.eager_msgs_sent, 12);
        assert_eq!(
            (
                total.reg_cache_hits,
                total.reg_cache_misses,
                total.remote_read_bytes
            ),
            (2, 1, 10)
        );
        assert_eq!(
            (total.provider, total.proto.eager_threshold),
            ("verbs", 8192)
        );
        total.accumulate(&b);
        assert_eq!((total.inline_reads, total.inline_copies), (6, 8));
        assert_eq!((total.pushes.sent, total.pushes.held), (10, 2));
    }
}
