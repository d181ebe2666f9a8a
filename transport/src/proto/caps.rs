//! What the core knows of its link, and the decisions it makes from that: what the
//! connect-time probe measures, how a message's memory is readied for the link, and
//! whether a body is pushed behind its RTS. The driver and the link carry the decisions out; providers only describe
//! themselves (`LinkInfo`), so no decision depends on which provider a link is.

use super::Protocol;
use crate::config::Config;

/// The link's capabilities that the core's decisions depend on, from `LinkInfo::caps`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkCaps {
    /// Exposing memory that is not registered already registers it (verbs): the link has a
    /// `Registrar`, and registered memory to copy into.
    pub registers: bool,
    /// A read moves an exposed buffer into the reader's destination with no copy of the
    /// link's own (`LinkInfo::direct_reads`).
    pub direct_reads: bool,
    /// The longest message body the link can push behind the RTS that announces it, so
    /// that the peer's reads are filled without a request (tcp, towards a peer that takes
    /// pushes: `LinkInfo::max_push`); 0 where it cannot push.
    pub max_push: usize,
    /// The longest single read the link takes; fragments are never longer.
    pub max_read: usize,
    /// Reads cross a network in pipelined work requests (`LinkInfo::pipelined_reads`).
    pub pipelined_reads: bool,
    /// Reads are done by the NIC, not by a CPU copy (`LinkInfo::dma_reads`).
    pub dma_reads: bool,
}

impl Default for LinkCaps {
    /// A link that reads any memory as it is, pushes nothing and takes reads of any length.
    fn default() -> Self {
        LinkCaps {
            registers: false,
            direct_reads: false,
            max_push: 0,
            max_read: usize::MAX,
            pipelined_reads: false,
            dma_reads: false,
        }
    }
}

/// Rendezvous sends of unregistered memory up to this long are copied into registered
/// memory instead of being registered. Such a buffer (an encoded gRPC body, say) would be
/// registered for this one send and never hit the registration cache again, and the memcpy of at most 1 MiB (about 50 µs here, less
/// for the typical few-KiB body) is cheaper than registering and deregistering pages that
/// the next send will not reuse. Longer ones are registered (and cached), where the copy
/// would cost more than the registration. A copy fits one slab of registered memory
/// (`config::VERBS_SLAB`).
pub const COPY_MAX: usize = 1 << 20;

const _: () = assert!(COPY_MAX <= crate::config::VERBS_SLAB);

/// How the driver readies a message's memory before queueing it ([`LinkCaps::staging`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Staging {
    /// Send it from where it is: the link reads it as it is, or it travels in a slot.
    AsIs,
    /// Copy it into memory the link has registered, and send the copy.
    Copy,
    /// Register it (off the runtime) so that its exposure finds it registered.
    Register,
}

impl LinkCaps {
    /// `config` with what the connect-time probe picks narrowed to what pays on this link.
    pub fn tune(&self, config: &Config) -> Config {
        let mut config = config.clone();
        // The fragment size matters where reads are pipelined over a network (RDMA READ).
        // On shm (one CMA copy) and tcp (a stream) the probe's read samples (tens of MiB per
        // connection) cost more than any fragment size wins back: measured, six fresh
        // connections probing made a short ps-throughput run 20x slower.
        if !self.pipelined_reads {
            config.probe_fragments = false;
        }
        // Where a rendezvous read is a CPU copy (shm, tcp), eager wins at every size a slot
        // takes: measured with fixed thresholds, 2-4x on shm and about 3x on tcp at 4-60 KiB.
        // The probe's samples could not see it (each pays a wake-up of tens of microseconds)
        // and picked thresholds from 1 to 64 KiB at random from one connection to the next.
        if !self.dma_reads {
            config.probe_threshold = false;
        }
        config
    }

    /// How a message of `len` bytes that goes by `protocol` is readied for this link.
    /// `unregistered` says whether exposing its memory would register it now; it is asked
    /// only where that matters (a rendezvous send on a link that registers).
    pub fn staging(
        &self,
        protocol: Protocol,
        len: usize,
        unregistered: impl FnOnce() -> bool,
    ) -> Staging {
        if !self.registers || protocol != Protocol::Rendezvous || !unregistered() {
            Staging::AsIs
        } else if len <= COPY_MAX {
            Staging::Copy
        } else {
            Staging::Register
        }
    }

    /// The smallest buffer worth sending by descriptor, for the peer to read into its own
    /// destination, rather than inside a message body; `None` where reads are not direct.
    ///
    /// A message body costs copies above the link that a read does not: the sender encodes
    /// the buffer into the body, and the receiver copies the body's pieces together and
    /// then out into the buffer it wanted. A descriptor costs an exposure, a lease and a
    /// read's round trip instead. The copies outweigh the trip from half a rendezvous
    /// fragment up, and never for what travels eagerly (at least twice the eager
    /// threshold); `fragment_size` and `eager_threshold` are the connection's own.
    ///
    /// That holds on tcp as on shared memory: its reads are served from the owner's
    /// buffer and land in the reader's destination, one kernel copy each way, the same as a
    /// message body's, so only the copies above the link differ.
    pub fn remote_min(&self, fragment_size: usize, eager_threshold: usize) -> Option<usize> {
        self.direct_reads
            .then(|| (fragment_size / 2).max(eager_threshold.saturating_mul(2)))
    }

    /// Whether a rendezvous body of `len` bytes is pushed behind its RTS. The peer reads
    /// the body whole right after the RTS, so pushing it saves the read request's trip;
    /// anything the link can push goes (an empty body has nothing to read).
    pub fn pushes(&self, len: usize) -> bool {
        len > 0 && len <= self.max_push
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unregistered_rendezvous_sends_are_copied_up_to_copy_max_and_registered_past_it() {
        let verbs = LinkCaps {
            registers: true,
            ..LinkCaps::default()
        };
        let rndv = Protocol::Rendezvous;
        assert_eq!(verbs.staging(rndv, 100, || true), Staging::Copy);
        assert_eq!(verbs.staging(rndv, COPY_MAX, || true), Staging::Copy);
        assert_eq!(
            verbs.staging(rndv, COPY_MAX + 1, || true),
            Staging::Register
        );
        // Registered memory (a slab, the pool, a cached range) is sent as it is.
        assert_eq!(verbs.staging(rndv, 100, || false), Staging::AsIs);
        assert_eq!(verbs.staging(rndv, COPY_MAX + 1, || false), Staging::AsIs);
        // Eager messages are copied into a slot anyway; memory is never asked about.
        assert_eq!(
            verbs.staging(Protocol::Eager, 100, || panic!("asked about an eager send")),
            Staging::AsIs
        );
        // A link that reads any memory (shm, tcp) never needs either.
        assert_eq!(
            LinkCaps::default().staging(rndv, 100, || panic!("asked without registration")),
            Staging::AsIs
        );
    }

    #[test]
    fn the_probe_measures_only_what_pays_on_the_link() {
        let c = Config::default();
        let copies = LinkCaps::default().tune(&c);
        assert!(!copies.probe_fragments && !copies.probe_threshold);
        let rdma = LinkCaps {
            pipelined_reads: true,
            dma_reads: true,
            ..LinkCaps::default()
        }
        .tune(&c);
        assert_eq!(
            (rdma.probe_fragments, rdma.probe_threshold),
            (c.probe_fragments, c.probe_threshold)
        );
    }

    #[test]
    fn buffers_go_by_descriptor_only_where_reads_are_direct() {
        let direct = LinkCaps {
            direct_reads: true,
            ..LinkCaps::default()
        };
        assert_eq!(direct.remote_min(512 << 10, 16 << 10), Some(256 << 10));
        assert_eq!(
            direct.remote_min(128 << 10, 256 << 10),
            Some(512 << 10),
            "never below twice the eager threshold"
        );
        assert_eq!(LinkCaps::default().remote_min(512 << 10, 16 << 10), None);
    }

    #[test]
    fn bodies_are_pushed_up_to_what_the_link_pushes() {
        let tcp = LinkCaps {
            max_push: 2 << 20,
            ..LinkCaps::default()
        };
        assert!(tcp.pushes(1));
        assert!(tcp.pushes(2 << 20));
        assert!(!tcp.pushes((2 << 20) + 1));
        assert!(!tcp.pushes(0), "an empty body has nothing to push");
        assert!(!LinkCaps::default().pushes(1), "a link that cannot push");
    }
}
