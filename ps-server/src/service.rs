//! The gRPC face of a shard: decodes tensors (inline, or pulled one-sided from a buffer the
//! worker exposed), maps requests to [`Shard`] calls, and times every RPC.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use futures_util::future::try_join_all;
use ibex_proto::ps::v1 as pb;
use ibex_proto::ps::v1::parameter_server_server::ParameterServer;
use ibex_transport::RecvBuf;
use ibex_transport::grpc::PeerHandle;
use tonic::{Request, Response, Status};

use crate::bufs::{Buf, F32s};
use crate::exposed::{ExposeLimits, Exposures};
use crate::metrics::Metrics;
use crate::shard::{self, Grad, Shard, Values};

/// The `ibex.ps.v1.ParameterServer` implementation over one shard.
#[derive(Clone)]
pub struct PsService {
    shard: Arc<Shard>,
    metrics: Arc<Metrics>,
    exposed: Arc<Exposures>,
}

impl PsService {
    /// Serves `shard`, counting into `metrics`.
    pub fn new(shard: Arc<Shard>, metrics: Arc<Metrics>) -> PsService {
        PsService {
            shard,
            metrics,
            exposed: Exposures::new(ExposeLimits::default()),
        }
    }

    /// Bounds what unreleased pull replies may hold per connection (see docs/ps.md).
    pub fn with_expose_limits(mut self, limits: ExposeLimits) -> PsService {
        self.exposed = Exposures::new(limits);
        self
    }

    /// Pull-reply leases held now, over all connections.
    pub fn exposed_leases(&self) -> usize {
        self.exposed.held()
    }

    /// Ends the leases a request says its worker has read.
    fn release(&self, peer: Option<&PeerHandle>, ids: &[u64]) {
        if let Some(p) = peer {
            self.exposed.release(p.id(), ids);
        }
    }

    async fn timed<T>(
        &self,
        method: &'static str,
        f: impl Future<Output = Result<T, Status>>,
    ) -> Result<Response<T>, Status> {
        let t0 = Instant::now();
        let r = f.await;
        self.metrics.observe(method, t0.elapsed(), r.is_ok());
        if let Err(s) = &r {
            tracing::debug!(method, code = ?s.code(), message = s.message(), "request failed");
        }
        r.map(Response::new)
    }

    /// The f32 values of `t`: the request body's bytes as they are (inline), or read from
    /// the worker's memory straight into a pooled, f32-aligned buffer that the optimizer
    /// consumes in place (remote). `expected` is the element count the variable takes:
    /// checked before anything is read or allocated, so a bogus shape or length costs nothing.
    async fn values(
        &self,
        peer: Option<&PeerHandle>,
        t: &pb::Tensor,
        expected: u64,
    ) -> Result<F32s, Status> {
        if t.dtype != pb::Dtype::F32 as i32 {
            return Err(Status::invalid_argument(format!(
                "tensor {:?} has dtype {}; gradients travel as F32 whatever the variable's storage dtype",
                t.name, t.dtype
            )));
        }
        let numel = shard::numel(&t.shape)
            .filter(|&n| n == expected)
            .ok_or_else(|| {
                Status::invalid_argument(format!(
                    "tensor {:?} has shape {:?}; {expected} elements were expected",
                    t.name, t.shape
                ))
            })?;
        let want = numel.checked_mul(4);
        let values = match &t.data {
            Some(pb::tensor::Data::Inline(b)) => {
                if Some(b.len() as u64) != want {
                    return Err(Status::invalid_argument(format!(
                        "tensor {:?}: {} B of data do not match shape {:?} in f32 ({numel} elements)",
                        t.name,
                        b.len(),
                        t.shape,
                    )));
                }
                F32s::Le(b.clone())
            }
            Some(pb::tensor::Data::Remote(r)) => {
                let peer = peer.ok_or_else(|| {
                    Status::invalid_argument(format!(
                        "tensor {:?} is a remote buffer, but this channel has no one-sided reads (stock gRPC): send it inline",
                        t.name
                    ))
                })?;
                if Some(r.len) != want {
                    return Err(Status::invalid_argument(format!(
                        "tensor {:?}: remote buffer of {} B does not hold shape {:?} in f32",
                        t.name, r.len, t.shape
                    )));
                }
                let buf = self.read_into_pool(peer, t, r, numel as usize).await?;
                self.metrics
                    .bytes_remote
                    .fetch_add(r.len, Ordering::Relaxed);
                F32s::Buf(buf)
            }
            None => {
                return Err(Status::invalid_argument(format!(
                    "tensor {:?} carries no data",
                    t.name
                )));
            }
        };
        self.metrics
            .bytes_pushed
            .fetch_add(numel * 4, Ordering::Relaxed);
        Ok(values)
    }

    /// One-sided read of `r` into a buffer from the shard's pool.
    async fn read_into_pool(
        &self,
        peer: &PeerHandle,
        t: &pb::Tensor,
        r: &pb::RemoteRef,
        numel: usize,
    ) -> Result<Buf, Status> {
        let mut buf = self.shard.bufs.take(numel).map_err(|e| {
            Status::resource_exhausted(format!("a receive buffer for tensor {:?}: {e}", t.name))
        })?;
        let ptr = buf.as_mut_ptr().cast::<u8>();
        // SAFETY: the buffer is `numel` f32 = `numel * 4` bytes at `ptr`, owned by the box
        // handed to the RecvBuf, which keeps it alive and in place (a Vec's heap memory does
        // not move when its owner does) and unaliased until the RecvBuf gives it back.
        let dst = unsafe { RecvBuf::from_raw(ptr, numel * 4, Box::new(buf)) };
        let read = peer
            .read_remote(r.descriptor.clone(), dst)
            .await
            .map_err(|e| {
                Status::invalid_argument(format!(
                    "reading tensor {:?} from the worker: {e}",
                    t.name
                ))
            })?;
        let mut buf = read
            .into_owner()
            .downcast::<Buf>()
            .map_err(|_| Status::internal("the transport returned a different receive buffer"))?;
        #[cfg(target_endian = "big")]
        for x in buf.iter_mut() {
            *x = f32::from_bits(u32::from_le(x.to_bits()));
        }
        Ok(std::mem::take(&mut *buf))
    }

    /// Checks dense gradients against their variables, then reads all of them at once (the
    /// remote ones are one-sided reads that overlap on the link).
    async fn grads(
        &self,
        peer: Option<&PeerHandle>,
        tensors: &[pb::Tensor],
    ) -> Result<Vec<Grad>, Status> {
        let mut expected = Vec::with_capacity(tensors.len());
        for t in tensors {
            let (shape, _) = self.shard.shape_of(&t.name)?;
            if shape != t.shape {
                return Err(Status::invalid_argument(format!(
                    "gradient for {:?} has shape {:?}, the variable has shape {:?}",
                    t.name, t.shape, shape
                )));
            }
            expected.push(shard::numel(&shape).unwrap_or(0));
        }
        try_join_all(tensors.iter().zip(expected).map(|(t, n)| async move {
            Ok::<_, Status>(Grad::Dense {
                name: t.name.clone(),
                values: self.values(peer, t, n).await?,
            })
        }))
        .await
    }

    fn tensors(&self, vals: Vec<Values>) -> Vec<pb::Tensor> {
        vals.into_iter()
            .map(|(name, shape, b)| self.inline(name, &shape, b))
            .collect()
    }

    fn inline(&self, name: String, shape: &[usize], b: bytes::Bytes) -> pb::Tensor {
        self.metrics
            .bytes_pulled
            .fetch_add(b.len() as u64, Ordering::Relaxed);
        pb::Tensor {
            name,
            dtype: pb::Dtype::F32 as i32,
            shape: shape.iter().map(|&d| d as u64).collect(),
            data: Some(pb::tensor::Data::Inline(b)),
        }
    }

    /// Reply tensors for a pull: on a channel that reads one-sided, each value buffer of at
    /// least the connection's `remote_min` is exposed and sent as a descriptor with a lease,
    /// so the worker copies it once, straight into its own vector; smaller ones, other
    /// channels, and any past the connection's lease limits go inline. Each buffer is the snapshot
    /// `Shard::read` copied under the variable's lock, owned by the lease from here on, so
    /// no later step can change what the worker reads.
    async fn pull_tensors(&self, peer: Option<&PeerHandle>, vals: Vec<Values>) -> Vec<pb::Tensor> {
        let Some((peer, min)) = peer.and_then(|p| Some((p, p.remote_min()?))) else {
            return self.tensors(vals);
        };
        let mut out = Vec::with_capacity(vals.len());
        for (name, shape, b) in vals {
            let len = b.len() as u64;
            let lease = if b.len() >= min {
                self.exposed.reserve(peer.id(), len)
            } else {
                None
            };
            let Some(lease) = lease else {
                out.push(self.inline(name, &shape, b));
                continue;
            };
            match peer.expose(b.clone()).await {
                Ok(remote) => {
                    let descriptor = remote.descriptor();
                    self.exposed.attach(lease, remote);
                    self.metrics.bytes_pulled.fetch_add(len, Ordering::Relaxed);
                    self.metrics
                        .bytes_pulled_exposed
                        .fetch_add(len, Ordering::Relaxed);
                    out.push(pb::Tensor {
                        name,
                        dtype: pb::Dtype::F32 as i32,
                        shape: shape.iter().map(|&d| d as u64).collect(),
                        data: Some(pb::tensor::Data::Remote(pb::RemoteRef {
                            descriptor,
                            len,
                            lease,
                        })),
                    });
                }
                Err(e) => {
                    // The body always works: a failed exposure costs a copy, not the pull.
                    tracing::debug!(tensor = %name, error = %e, "exposing a pull reply failed; sending it inline");
                    self.exposed.cancel(lease);
                    out.push(self.inline(name, &shape, b));
                }
            }
        }
        out
    }

    async fn do_push(&self, req: Request<pb::PushRequest>) -> Result<(u64, Vec<String>), Status> {
        let peer = req.extensions().get::<PeerHandle>().cloned();
        let r = req.into_inner();
        self.release(peer.as_ref(), &r.release);
        let grads = self.grads(peer.as_ref(), &r.grads).await?;
        let names = r.grads.iter().map(|t| t.name.clone()).collect();
        let step = self.shard.push(r.step, r.worker, grads).await?;
        Ok((step, names))
    }
}

/// Where a pull's snapshots go: memory the connection exposes with no registration, when
/// the worker reads them one-sided and exposing other memory would register (verbs).
/// Elsewhere (shm's CMA reads any memory) the shard's own buffers serve: taking the
/// connection's pool there would only add the snapshots to the worker's mapped pages.
/// Runs where blocking is fine: it may register.
fn pull_pool(
    peer: &Option<PeerHandle>,
) -> impl Fn(usize) -> Option<ibex_transport::PoolBufMut> + Send + 'static {
    // Only snapshots that will be answered by descriptor gain from registered memory.
    let peer = peer
        .clone()
        .filter(|p| p.exposing_registers())
        .and_then(|p| Some((p.remote_min()?, p)));
    move |len| {
        peer.as_ref()
            .filter(|(min, _)| len >= *min)
            .and_then(|(_, p)| p.alloc(len).ok())
    }
}

#[tonic::async_trait]
impl ParameterServer for PsService {
    async fn create_variables(
        &self,
        req: Request<pb::CreateVariablesRequest>,
    ) -> Result<Response<pb::CreateVariablesResponse>, Status> {
        self.timed("CreateVariables", async {
            let created = self.shard.create(req.into_inner().vars)?;
            Ok(pb::CreateVariablesResponse { created })
        })
        .await
    }

    async fn pull(
        &self,
        req: Request<pb::PullRequest>,
    ) -> Result<Response<pb::PullResponse>, Status> {
        self.timed("Pull", async {
            let peer = req.extensions().get::<PeerHandle>().cloned();
            let r = req.into_inner();
            self.release(peer.as_ref(), &r.release);
            self.shard.wait_for(r.step).await?;
            let (step, vals) = self.shard.read_to(r.names, pull_pool(&peer)).await?;
            Ok(pb::PullResponse {
                step,
                values: self.pull_tensors(peer.as_ref(), vals).await,
            })
        })
        .await
    }

    async fn push(
        &self,
        req: Request<pb::PushRequest>,
    ) -> Result<Response<pb::PushResponse>, Status> {
        self.timed("Push", async {
            let (step, _) = self.do_push(req).await?;
            Ok(pb::PushResponse { step })
        })
        .await
    }

    async fn push_pull(
        &self,
        req: Request<pb::PushRequest>,
    ) -> Result<Response<pb::PullResponse>, Status> {
        self.timed("PushPull", async {
            let step = req.get_ref().step;
            let peer = req.extensions().get::<PeerHandle>().cloned();
            // A hostile step (u64::MAX) must not overflow the step to wait for.
            let next = step.checked_add(1).ok_or_else(|| {
                Status::invalid_argument(format!(
                    "PushPull step {step} has no next step; send the step the worker is on"
                ))
            })?;
            let (_, names) = self.do_push(req).await?;
            // Sync: the values after step `step`; async: the values right after this push.
            self.shard.wait_for(next).await?;
            let (now, vals) = self.shard.read_to(names, pull_pool(&peer)).await?;
            Ok(pb::PullResponse {
                step: now,
                values: self.pull_tensors(peer.as_ref(), vals).await,
            })
        })
        .await
    }

    async fn lookup_rows(
        &self,
        req: Request<pb::LookupRowsRequest>,
    ) -> Result<Response<pb::LookupRowsResponse>, Status> {
        self.timed("LookupRows", async {
            let r = req.into_inner();
            let n = r.ids.len();
            let (dim, v) = self.shard.lookup(r.table.clone(), r.ids).await?;
            let rows = self
                .tensors(vec![(
                    r.table,
                    vec![n, dim],
                    ibex_proto::tensor::f32_to_le_bytes(&v),
                )])
                .pop();
            Ok(pb::LookupRowsResponse { rows })
        })
        .await
    }

    async fn push_sparse(
        &self,
        req: Request<pb::PushSparseRequest>,
    ) -> Result<Response<pb::PushResponse>, Status> {
        self.timed("PushSparse", async {
            let peer = req.extensions().get::<PeerHandle>().cloned();
            let r = req.into_inner();
            let t = r
                .grads
                .ok_or_else(|| Status::invalid_argument("PushSparse without grads"))?;
            let dim = self.shard.table_dim(&r.table)?;
            let want = (r.ids.len() as u64)
                .checked_mul(dim as u64)
                .ok_or_else(|| {
                    Status::invalid_argument(format!("{} ids x dim {dim} overflows", r.ids.len()))
                })?;
            let values = self.values(peer.as_ref(), &t, want).await?;
            let grad = Grad::Sparse {
                name: r.table,
                ids: r.ids,
                values,
            };
            let step = self.shard.push(r.step, r.worker, vec![grad]).await?;
            Ok(pb::PushResponse { step })
        })
        .await
    }

    async fn save(
        &self,
        _req: Request<pb::SaveRequest>,
    ) -> Result<Response<pb::SaveResponse>, Status> {
        self.timed("Save", async {
            let (step, path) = self.shard.save().await?;
            Ok(pb::SaveResponse {
                step,
                path: path.display().to_string(),
            })
        })
        .await
    }

    async fn restore(
        &self,
        req: Request<pb::RestoreRequest>,
    ) -> Result<Response<pb::RestoreResponse>, Status> {
        self.timed("Restore", async {
            let step = self.shard.restore(req.into_inner().step).await?;
            Ok(pb::RestoreResponse { step })
        })
        .await
    }

    async fn stats(
        &self,
        _req: Request<pb::StatsRequest>,
    ) -> Result<Response<pb::StatsResponse>, Status> {
        self.timed("Stats", async {
            let cfg = &self.shard.cfg;
            let rpcs = self
                .metrics
                .snapshot()
                .into_iter()
                .map(|(m, r)| pb::RpcStat {
                    method: m.to_string(),
                    count: r.count,
                    errors: r.errors,
                    total_seconds: r.seconds,
                })
                .collect();
            Ok(pb::StatsResponse {
                shard: cfg.shard,
                step: self.shard.step(),
                mode: cfg.mode.as_str().to_string(),
                num_workers: cfg.num_workers,
                checkpoint_steps: self.shard.checkpoints(),
                vars: self.shard.defs(),
                bytes_pushed: self.metrics.bytes_pushed.load(Ordering::Relaxed),
                bytes_pulled: self.metrics.bytes_pulled.load(Ordering::Relaxed),
                rpcs,
            })
        })
        .await
    }
}
