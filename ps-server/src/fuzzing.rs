//! Feeds arbitrary bytes to the PS's request handling, for the `ps_request` fuzz target
//! (`ps-server/fuzz`) and the stable replay of its seeds (`tests/fuzz_corpus.rs`). Not part
//! of the supported API.
//!
//! An input is one byte choosing the method and the shard, then the protobuf body a worker
//! would send. Every decoded request goes through [`PsService`] exactly as a served one
//! does (minus the transport), into shards with small limits, so shapes, offsets, dtypes,
//! names, ids and steps from the wire all reach the shard code.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ibex_proto::ps::v1 as pb;
use ibex_proto::ps::v1::parameter_server_server::ParameterServer;
use prost::Message;
use tonic::Request;

use crate::{Limits, Metrics, Mode, PsService, Shard, ShardConfig};

/// Longer than any wait a request can cause here (sync waits are 20 ms): past it the
/// handling hung.
const HANG: Duration = Duration::from_secs(5);

struct Target {
    rt: tokio::runtime::Runtime,
    /// An async shard and a sync one with two workers, where steps wait on each other.
    services: [PsService; 2],
}

fn target() -> &'static Target {
    static T: OnceLock<Target> = OnceLock::new();
    T.get_or_init(|| {
        let limits = Limits {
            max_variables: 64,
            max_elements: 1 << 16,
            max_bytes: 8 << 20,
        };
        let shard = |mode, num_workers| {
            let s = Shard::new(ShardConfig {
                shard: 0,
                num_workers,
                mode,
                sync_timeout: Duration::from_millis(20),
                checkpoint_dir: None,
                checkpoint_every: 0,
                limits,
                on_worker_loss: Default::default(),
            });
            PsService::new(Arc::new(s), Arc::new(Metrics::default()))
        };
        Target {
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .expect("a tokio runtime for the fuzz target"),
            services: [shard(Mode::Async, 1), shard(Mode::Sync, 2)],
        }
    })
}

/// Handles one input: `Ok(None)` when the body is not the method's protobuf, else the
/// gRPC code the PS answered. `Err` only for a broken invariant: a hang. (A panic is the
/// other broken invariant; the fuzzer catches it.)
pub fn feed(data: &[u8]) -> Result<Option<tonic::Code>, String> {
    let Some((&op, body)) = data.split_first() else {
        return Ok(None);
    };
    let t = target();
    let svc = &t.services[usize::from(op >> 7)];
    let run = async {
        macro_rules! call {
            ($method:ident, $ty:ty) => {{
                let Ok(req) = <$ty>::decode(body) else {
                    return None;
                };
                Some(match svc.$method(Request::new(req)).await {
                    Ok(_) => tonic::Code::Ok,
                    Err(s) => s.code(),
                })
            }};
        }
        match op & 0x7f {
            0 => call!(create_variables, pb::CreateVariablesRequest),
            1 => call!(pull, pb::PullRequest),
            2 => call!(push, pb::PushRequest),
            3 => call!(push_pull, pb::PushRequest),
            4 => call!(lookup_rows, pb::LookupRowsRequest),
            5 => call!(push_sparse, pb::PushSparseRequest),
            6 => call!(restore, pb::RestoreRequest),
            _ => call!(stats, pb::StatsRequest),
        }
    };
    t.rt.block_on(async { tokio::time::timeout(HANG, run).await })
        .map_err(|_| format!("request (method byte {op:#04x}) still running after {HANG:?}"))
}

/// The method byte of each request type, for building seeds.
pub mod op {
    /// `CreateVariables` on the async shard.
    pub const CREATE: u8 = 0;
    /// `Pull`.
    pub const PULL: u8 = 1;
    /// `Push`.
    pub const PUSH: u8 = 2;
    /// `PushPull`.
    pub const PUSH_PULL: u8 = 3;
    /// `LookupRows`.
    pub const LOOKUP: u8 = 4;
    /// `PushSparse`.
    pub const PUSH_SPARSE: u8 = 5;
    /// `Restore` (no checkpoint directory here: always refused).
    pub const RESTORE: u8 = 6;
    /// `Stats`.
    pub const STATS: u8 = 7;
    /// Set to address the sync shard instead.
    pub const SYNC: u8 = 0x80;
}
