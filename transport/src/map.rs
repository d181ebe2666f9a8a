//! The hash map for per-message bookkeeping (calls, messages, reads in flight).
//!
//! std's default hasher is SipHash-1-3: callgrind counted 100-140 instructions per lookup,
//! seven lookups per 64 B gRPC call on the server and six on the client, on integer keys. foldhash
//! is several times cheaper and still seeded per process, so a peer that picks its own
//! call or message ids cannot aim them at one bucket without knowing the seed (and the
//! maps it fills are bounded by per-connection limits anyway).

/// A `HashMap` with foldhash's seeded hasher.
pub(crate) type Map<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
