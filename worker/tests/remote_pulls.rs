//! Pull replies as descriptors: over shm and tcp the PS exposes its snapshot of each large
//! variable and the worker reads it into its own vector (one-sided over shm; over tcp the
//! PS's link streams it and the worker's link reads the socket straight into the vector);
//! small variables, stock gRPC channels and a connection past its lease cap get the bytes in
//! the body. Values are bit-for-bit those of inline pulls.

use std::time::{Duration, Instant};

use ibex_ps::{ExposeLimits, Mode, PsConfig};
use ibex_worker::pb::parameter_server_ibex::ParameterServerClient;
use ibex_worker::{ClusterSpec, Dtype, Init, Optimizer, TransportKind, VarSpec, pb};

mod common;
use common::free_port;

/// One sync-mode shard for one worker, with `expose` as its lease limits.
fn start(
    transport: TransportKind,
    expose: ExposeLimits,
) -> (ClusterSpec, tokio::sync::oneshot::Sender<()>) {
    let spec = ClusterSpec {
        ps: vec![format!("127.0.0.1:{}", free_port())],
        workers: vec!["127.0.0.1:0".into()],
        transport,
        timeouts: Default::default(),
    };
    let mut cfg = PsConfig::new(spec.ps_uri(0));
    cfg.num_workers = 1;
    cfg.mode = Mode::Sync;
    cfg.sync_timeout = Duration::from_secs(20);
    cfg.expose = expose;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(ibex_ps::run(cfg, async move {
        let _ = rx.await;
    }));
    (spec, tx)
}

/// "mid" is 512 KiB (one part), "big" 2 MiB (two parts of 1 MiB), "small" 1 KiB.
const SHAPES: [(&str, &[usize]); 3] = [
    ("mid", &[128, 1024]),
    ("big", &[1024, 512]),
    ("small", &[16, 16]),
];
const LARGE_BYTES: u64 = (128 * 1024 + 1024 * 512) * 4;
const STEPS: u64 = 4;

fn vars() -> Vec<VarSpec> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, (n, s))| VarSpec {
            name: (*n).into(),
            dtype: Dtype::F32,
            shape: s.to_vec(),
            init: Init::Normal {
                std: 0.5,
                seed: 7 + i as u64,
            },
            optimizer: Optimizer::Momentum {
                lr: 0.1,
                momentum: 0.9,
            },
            sparse: false,
        })
        .collect()
}

/// `STEPS` push-pulls into reused vectors, then a plain pull; returns every step's values
/// and the worker's total one-sided read bytes.
async fn train(spec: &ClusterSpec) -> (Vec<Vec<Vec<f32>>>, u64) {
    let w = common::connect_worker(spec, 0).await.unwrap();
    w.create_variables(&vars()).await.unwrap();
    let names: Vec<&str> = SHAPES.iter().map(|(n, _)| *n).collect();
    let mut out = vec![Vec::new(); names.len()];
    let mut seen = Vec::new();
    w.pull_into(&names, 0, &mut out).await.unwrap();
    seen.push(out.clone());
    for step in 0..STEPS {
        let grads: Vec<Vec<f32>> = out
            .iter()
            .map(|v| {
                v.iter()
                    .enumerate()
                    .map(|(i, x)| x * 0.5 + (i % 13) as f32 * 0.01 - step as f32)
                    .collect()
            })
            .collect();
        let g: Vec<(&str, &[f32])> = names
            .iter()
            .zip(&grads)
            .map(|(n, g)| (*n, g.as_slice()))
            .collect();
        w.push_pull_into(step, &g, &mut out).await.unwrap();
        seen.push(out.clone());
    }
    seen.push(w.pull(&names, STEPS).await.unwrap());
    let read = w
        .comm_profile()
        .transport
        .iter()
        .map(|(_, s)| s.remote_read_bytes)
        .sum();
    (seen, read)
}

fn assert_bits_equal(a: &[Vec<Vec<f32>>], b: &[Vec<Vec<f32>>]) {
    assert_eq!(a.len(), b.len());
    for (step, (x, y)) in a.iter().zip(b).enumerate() {
        for (i, (u, v)) in x.iter().zip(y).enumerate() {
            assert_eq!(u.len(), v.len());
            assert!(
                u.iter().zip(v).all(|(p, q)| p.to_bits() == q.to_bits()),
                "pull {step}, variable {:?} differs",
                SHAPES[i].0
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_pulls_are_read_by_descriptor_and_equal_inline_pulls() {
    // Stock gRPC has no descriptors: every reply travels in the body.
    let (grpc, stop_grpc) = start(TransportKind::Grpc, ExposeLimits::default());
    let (inline, grpc_read) = train(&grpc).await;
    assert_eq!(
        grpc_read, 0,
        "a stock gRPC channel gets pull replies inline"
    );
    drop(stop_grpc);

    for kind in [TransportKind::Shm, TransportKind::Tcp] {
        let (spec, stop) = start(kind, ExposeLimits::default());
        let (remote, read) = train(&spec).await;
        assert_bits_equal(&inline, &remote);
        // Every pull (the first, one per step, the last) read each large part by
        // descriptor, and nothing of "small": it stays inline.
        assert_eq!(
            read,
            LARGE_BYTES * (STEPS + 2),
            "{kind:?}: read bytes on the worker"
        );
        drop(stop);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_lease_cap_replies_go_inline_and_released_leases_free_room() {
    // One lease per connection: each reply exposes one large part and sends the rest
    // inline. The next request releases it, so every pull gets its one again.
    let one = ExposeLimits {
        max_leases: 1,
        ..ExposeLimits::default()
    };
    let (grpc, stop_grpc) = start(TransportKind::Grpc, ExposeLimits::default());
    let (inline, _) = train(&grpc).await;
    drop(stop_grpc);
    let (shm, stop_shm) = start(TransportKind::Shm, one);
    let (capped, read) = train(&shm).await;
    assert_bits_equal(&inline, &capped);
    let pulls = STEPS + 2;
    // Each pull read exactly one part one-sided: 512 KiB ("mid") or 1 MiB (a "big" part).
    assert!(
        read >= pulls * (512 << 10) && read <= pulls * (1 << 20),
        "{read} B read one-sided over {pulls} pulls"
    );
    drop(stop_shm);
}

/// A plain gRPC client of the PS on a connection of its own, which releases only what the
/// test names.
type RawClient = ParameterServerClient<ibex_transport::grpc::Channel>;

/// A pull of three large parts, one more than the lease cap of 2.
fn capped_pull() -> pb::PullRequest {
    pb::PullRequest {
        names: vec!["big/part_0".into(), "big/part_1".into(), "mid".into()],
        step: 0,
        worker: 0,
        release: vec![],
    }
}

fn remote(r: &pb::PullResponse) -> usize {
    r.values
        .iter()
        .filter(|t| matches!(t.data, Some(pb::tensor::Data::Remote(_))))
        .count()
}

fn lease_ids(r: &pb::PullResponse) -> Vec<u64> {
    r.values
        .iter()
        .filter_map(|t| match &t.data {
            Some(pb::tensor::Data::Remote(r)) => Some(r.lease),
            _ => None,
        })
        .collect()
}

/// Pulls every 100 ms until a reply exposes two parts again, i.e. until every lease `raw`
/// held has expired (within 30 s, or `why` fails the test). Returns that reply and when its
/// request went out: its leases cannot expire before then plus the timeout.
async fn until_exposed(raw: &mut RawClient, why: &str) -> (Instant, pb::PullResponse) {
    let give_up = Instant::now() + Duration::from_secs(30);
    // The two leases of one reply are reserved a moment apart, so a sweep can expire one
    // without the other. A poll that then gets one part exposed hands it back with the
    // next poll, so that only the leases being waited for hold room, never the poll's own.
    let mut release = Vec::new();
    loop {
        let sent = Instant::now();
        let mut req = capped_pull();
        req.release = std::mem::take(&mut release);
        let r = raw.pull(req).await.unwrap().into_inner();
        if remote(&r) == 2 {
            return (sent, r);
        }
        assert!(Instant::now() < give_up, "{why}: still held after 30 s");
        release = lease_ids(&r);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_never_releases_holds_a_bounded_amount_until_the_timeout() {
    // The pulls checked against live leases normally take milliseconds, well inside this;
    // the test waits about this long for expiry.
    let timeout = Duration::from_secs(2);
    let limits = ExposeLimits {
        max_leases: 2,
        max_bytes: 1 << 30,
        timeout,
    };
    let (spec, stop) = start(TransportKind::Shm, limits);
    let w = common::connect_worker(&spec, 0).await.unwrap();
    w.create_variables(&vars()).await.unwrap();
    // A raw client on its own connection that never names a lease in `release`.
    let mut raw = ParameterServerClient::new(
        ibex_transport::grpc::Channel::connect(&spec.ps_uri(0))
            .await
            .unwrap(),
    );
    let mut sent = Instant::now();
    let first = raw.pull(capped_pull()).await.unwrap().into_inner();
    assert_eq!(remote(&first), 2, "two leases, then inline");
    let give_up = Instant::now() + Duration::from_secs(30);
    loop {
        let second = raw.pull(capped_pull()).await.unwrap().into_inner();
        let mut bogus = capped_pull();
        bogus.release = vec![0, u64::MAX, 12345];
        let bogus = raw.pull(bogus).await.unwrap().into_inner();
        // Leases live at least `timeout` from the request that took them: replies back
        // before then were answered while both were held. On a machine too loaded for
        // that, the replies say nothing about the cap, and the check is redone on leases
        // taken afresh once these have expired.
        if sent.elapsed() < timeout {
            assert_eq!(remote(&second), 0, "the cap is reached: all inline");
            // Releasing ids this connection was not given does nothing.
            assert_eq!(remote(&bogus), 0, "a bogus release freed room");
            break;
        }
        assert!(
            Instant::now() < give_up,
            "two pulls never fit within the {timeout:?} lease"
        );
        (sent, _) = until_exposed(&mut raw, "leases taken before a slow round").await;
    }
    // The worker's own connection has its own allowance.
    let names = ["big", "mid"];
    w.pull(&names, 0).await.unwrap();
    // After the timeout the leases are gone and exposures resume.
    let (_, third) = until_exposed(&mut raw, "expired leases free their room").await;
    // Releasing them by id frees room at once.
    let ids = lease_ids(&third);
    assert!(ids.iter().all(|&id| id != 0));
    let mut rel = capped_pull();
    rel.release = ids;
    assert_eq!(remote(&raw.pull(rel).await.unwrap().into_inner()), 2);
    drop(stop);
}

/// A PS that answers every pull with a remote tensor of its choosing.
#[derive(Clone, Copy)]
enum Lie {
    /// `len` off by 4 bytes from the variable's size.
    WrongLen,
    /// The right `len`, a descriptor that names nothing.
    BogusDescriptor,
    /// The right `len`, a real exposure of fewer bytes.
    ShortExposure,
}

struct Hostile(Lie);

#[tonic::async_trait]
impl pb::parameter_server_server::ParameterServer for Hostile {
    async fn create_variables(
        &self,
        req: tonic::Request<pb::CreateVariablesRequest>,
    ) -> Result<tonic::Response<pb::CreateVariablesResponse>, tonic::Status> {
        Ok(tonic::Response::new(pb::CreateVariablesResponse {
            created: req.get_ref().vars.len() as u32,
        }))
    }
    async fn pull(
        &self,
        req: tonic::Request<pb::PullRequest>,
    ) -> Result<tonic::Response<pb::PullResponse>, tonic::Status> {
        let peer = req
            .extensions()
            .get::<ibex_transport::grpc::PeerHandle>()
            .cloned()
            .unwrap();
        let size = 128 * 1024 * 4u64;
        let mut keep = Vec::new();
        let mut values = Vec::new();
        for name in &req.get_ref().names {
            let (descriptor, len) = match self.0 {
                Lie::WrongLen => (vec![0u8; 16].into(), size + 4),
                Lie::BogusDescriptor => (vec![7u8; 16].into(), size),
                Lie::ShortExposure => {
                    let r = peer.expose(vec![1u8; 64].into()).await.unwrap();
                    let d = r.descriptor();
                    keep.push(r);
                    (d, size)
                }
            };
            values.push(pb::Tensor {
                name: name.clone(),
                dtype: pb::Dtype::F32 as i32,
                shape: vec![128, 1024],
                data: Some(pb::tensor::Data::Remote(pb::RemoteRef {
                    descriptor,
                    len,
                    lease: 1,
                })),
            });
        }
        // Held past the reply so the worker's read finds the exposure.
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(5)).await;
            drop(keep);
        });
        Ok(tonic::Response::new(pb::PullResponse { step: 0, values }))
    }
    async fn push(
        &self,
        _: tonic::Request<pb::PushRequest>,
    ) -> Result<tonic::Response<pb::PushResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("push"))
    }
    async fn push_pull(
        &self,
        _: tonic::Request<pb::PushRequest>,
    ) -> Result<tonic::Response<pb::PullResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("push_pull"))
    }
    async fn lookup_rows(
        &self,
        _: tonic::Request<pb::LookupRowsRequest>,
    ) -> Result<tonic::Response<pb::LookupRowsResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("lookup_rows"))
    }
    async fn push_sparse(
        &self,
        _: tonic::Request<pb::PushSparseRequest>,
    ) -> Result<tonic::Response<pb::PushResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("push_sparse"))
    }
    async fn save(
        &self,
        _: tonic::Request<pb::SaveRequest>,
    ) -> Result<tonic::Response<pb::SaveResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("save"))
    }
    async fn restore(
        &self,
        _: tonic::Request<pb::RestoreRequest>,
    ) -> Result<tonic::Response<pb::RestoreResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("restore"))
    }
    async fn stats(
        &self,
        _: tonic::Request<pb::StatsRequest>,
    ) -> Result<tonic::Response<pb::StatsResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("stats"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_pull_reply_is_a_clear_error_not_a_panic_or_an_over_read() {
    for lie in [Lie::WrongLen, Lie::BogusDescriptor, Lie::ShortExposure] {
        let spec = ClusterSpec {
            ps: vec![format!("127.0.0.1:{}", free_port())],
            workers: vec!["127.0.0.1:0".into()],
            transport: TransportKind::Shm,
            timeouts: Default::default(),
        };
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let svc = pb::parameter_server_server::ParameterServerServer::new(Hostile(lie));
        let uri = spec.ps_uri(0);
        tokio::spawn(async move {
            ibex_transport::grpc::Server::builder()
                .add_service(svc)
                .serve_any(&uri, async move {
                    let _ = rx.await;
                })
                .await
        });
        // The server task may not be listening yet.
        let t = std::time::Instant::now();
        let w = loop {
            match common::connect_worker(&spec, 0).await {
                Ok(w) => break w,
                Err(e) if t.elapsed() < std::time::Duration::from_secs(10) => {
                    let _ = e;
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                Err(e) => panic!("the hostile PS never came up: {e}"),
            }
        };
        w.create_variables(&vars()[..1]).await.unwrap();
        let mut out = vec![vec![5.0f32; 3]];
        let e = w.pull_into(&["mid"], 0, &mut out).await.unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("\"mid\""), "names the variable: {msg}");
        drop(tx);
    }
}

/// Memory a test owns outside any Vec, as a framework's tensor would be: freed when the
/// last owner handle goes.
struct Mem {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: the test writes the memory only through pulls and reads it after they returned.
unsafe impl Send for Mem {}
// SAFETY: as above.
unsafe impl Sync for Mem {}

impl Mem {
    fn new(len: usize) -> std::sync::Arc<Mem> {
        let b = vec![f32::NAN; len].into_boxed_slice();
        std::sync::Arc::new(Mem {
            ptr: Box::into_raw(b).cast::<f32>(),
            len,
        })
    }

    fn out(self: &std::sync::Arc<Mem>) -> ibex_worker::OutBuf {
        // SAFETY: `ptr..ptr + len` is this Mem's allocation, alive while the Arc is.
        unsafe { ibex_worker::OutBuf::from_raw(self.ptr, self.len, self.clone()) }
    }

    fn values(&self) -> Vec<f32> {
        // SAFETY: no pull into this memory runs while the test reads it.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }.to_vec()
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` came from `Box::into_raw` of a boxed slice of `len` values.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

/// [`train`] with every value read into caller memory ([`ibex_worker::OutBuf`]).
async fn train_into_bufs(spec: &ClusterSpec) -> (Vec<Vec<Vec<f32>>>, u64) {
    let w = common::connect_worker(spec, 0).await.unwrap();
    w.create_variables(&vars()).await.unwrap();
    let names: Vec<&str> = SHAPES.iter().map(|(n, _)| *n).collect();
    let mems: Vec<_> = SHAPES
        .iter()
        .map(|(_, s)| Mem::new(s.iter().product()))
        .collect();
    let bufs: Vec<_> = mems.iter().map(Mem::out).collect();
    let values = || mems.iter().map(|m| m.values()).collect::<Vec<_>>();
    let mut seen = Vec::new();
    w.pull_into_bufs(&names, 0, &bufs).await.unwrap();
    seen.push(values());
    for step in 0..STEPS {
        let grads: Vec<Vec<f32>> = values()
            .iter()
            .map(|v| {
                v.iter()
                    .enumerate()
                    .map(|(i, x)| x * 0.5 + (i % 13) as f32 * 0.01 - step as f32)
                    .collect()
            })
            .collect();
        let g: Vec<(&str, &[f32])> = names
            .iter()
            .zip(&grads)
            .map(|(n, g)| (*n, g.as_slice()))
            .collect();
        w.push_pull_into_bufs(step, &g, &bufs).await.unwrap();
        seen.push(values());
    }
    w.pull_into_bufs(&names, STEPS, &bufs).await.unwrap();
    seen.push(values());
    // A buffer of the wrong size is refused before anything is sent.
    let short = Mem::new(3);
    let e = w
        .pull_into_bufs(&["mid"], STEPS, &[short.out()])
        .await
        .unwrap_err();
    assert!(
        matches!(e, ibex_worker::WorkerError::ShapeMismatch { .. }),
        "{e}"
    );
    let read = w
        .comm_profile()
        .transport
        .iter()
        .map(|(_, s)| s.remote_read_bytes)
        .sum();
    (seen, read)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulls_into_caller_memory_are_read_one_sided_and_equal_pulls_into_vectors() {
    let (shm, stop) = start(TransportKind::Shm, ExposeLimits::default());
    let (vecs, vec_read) = train(&shm).await;
    drop(stop);
    let (shm, stop) = start(TransportKind::Shm, ExposeLimits::default());
    let (bufs, buf_read) = train_into_bufs(&shm).await;
    assert_bits_equal(&vecs, &bufs);
    assert_eq!(buf_read, vec_read, "the same parts read one-sided");
    assert_eq!(buf_read, LARGE_BYTES * (STEPS + 2));
    drop(stop);
}
