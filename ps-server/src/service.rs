//! The gRPC face of a shard: decodes tensors (inline, or pulled one-sided from a buffer the
//! worker exposed), maps requests to [`Shard`] calls, and times every RPC.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use bytes::Bytes;
use ibex_proto::ps::v1 as pb;
use ibex_proto::ps::v1::parameter_server_server::ParameterServer;
use ibex_transport::RecvBuf;
use ibex_transport::grpc::PeerHandle;
use tonic::{Request, Response, Status};

use crate::metrics::Metrics;
use crate::shard::{self, Grad, Shard, Values};

/// The `ibex.ps.v1.ParameterServer` implementation over one shard.
#[derive(Clone)]
pub struct PsService {
    shard: Arc<Shard>,
    metrics: Arc<Metrics>,
}

impl PsService {
    /// Serves `shard`, counting into `metrics`.
    pub fn new(shard: Arc<Shard>, metrics: Arc<Metrics>) -> PsService {
        PsService { shard, metrics }
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

    /// The f32 values of `t`, read from the worker's memory when it sent a descriptor.
    /// `expected` is the element count the variable takes: checked before anything is read
    /// or allocated, so a bogus shape or length costs nothing.
    async fn values(
        &self,
        peer: Option<&PeerHandle>,
        t: &pb::Tensor,
        expected: u64,
    ) -> Result<Vec<f32>, Status> {
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
        let bytes: Bytes = match &t.data {
            Some(pb::tensor::Data::Inline(b)) => b.clone(),
            Some(pb::tensor::Data::Remote(r)) => {
                let peer = peer.ok_or_else(|| {
                    Status::invalid_argument(format!(
                        "tensor {:?} is a remote buffer, but this channel has no one-sided reads (stock gRPC): send it inline",
                        t.name
                    ))
                })?;
                if r.len != numel * 4 {
                    return Err(Status::invalid_argument(format!(
                        "tensor {:?}: remote buffer of {} B does not hold shape {:?} in f32",
                        t.name, r.len, t.shape
                    )));
                }
                let buf = peer
                    .read_remote(r.descriptor.clone(), RecvBuf::heap(r.len as usize))
                    .await
                    .map_err(|e| {
                        Status::invalid_argument(format!(
                            "reading tensor {:?} from the worker: {e}",
                            t.name
                        ))
                    })?;
                self.metrics
                    .bytes_remote
                    .fetch_add(r.len, Ordering::Relaxed);
                buf.into_bytes()
            }
            None => {
                return Err(Status::invalid_argument(format!(
                    "tensor {:?} carries no data",
                    t.name
                )));
            }
        };
        if bytes.len() as u64 != numel * 4 {
            return Err(Status::invalid_argument(format!(
                "tensor {:?}: {} B of data do not match shape {:?} in f32 ({} B)",
                t.name,
                bytes.len(),
                t.shape,
                numel * 4
            )));
        }
        self.metrics
            .bytes_pushed
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(ibex_proto::tensor::f32_from_le_bytes(&bytes))
    }

    /// Decodes dense gradients, checking each tensor's declared shape against its variable.
    async fn grads(
        &self,
        peer: Option<&PeerHandle>,
        tensors: &[pb::Tensor],
    ) -> Result<Vec<Grad>, Status> {
        let defs = self.shard.defs();
        let mut out = Vec::with_capacity(tensors.len());
        for t in tensors {
            let d = defs.iter().find(|d| d.name == t.name).ok_or_else(|| {
                Status::not_found(format!(
                    "unknown variable {:?} on shard {}: create it with CreateVariables first",
                    t.name, self.shard.cfg.shard
                ))
            })?;
            if d.shape != t.shape {
                return Err(Status::invalid_argument(format!(
                    "gradient for {:?} has shape {:?}, the variable has shape {:?}",
                    t.name, t.shape, d.shape
                )));
            }
            let n = shard::numel(&d.shape).unwrap_or(0);
            out.push(Grad::Dense {
                name: t.name.clone(),
                values: self.values(peer, t, n).await?,
            });
        }
        Ok(out)
    }

    fn tensors(&self, vals: Vec<Values>) -> Vec<pb::Tensor> {
        vals.into_iter()
            .map(|(name, shape, v)| {
                let b = f32_bytes(&v);
                self.metrics
                    .bytes_pulled
                    .fetch_add(b.len() as u64, Ordering::Relaxed);
                pb::Tensor {
                    name,
                    dtype: pb::Dtype::F32 as i32,
                    shape: shape.iter().map(|&d| d as u64).collect(),
                    data: Some(pb::tensor::Data::Inline(b)),
                }
            })
            .collect()
    }

    async fn do_push(&self, req: Request<pb::PushRequest>) -> Result<(u64, Vec<String>), Status> {
        let peer = req.extensions().get::<PeerHandle>().cloned();
        let r = req.into_inner();
        let grads = self.grads(peer.as_ref(), &r.grads).await?;
        let names = r.grads.iter().map(|t| t.name.clone()).collect();
        let step = self.shard.push(r.step, r.worker, grads).await?;
        Ok((step, names))
    }
}

fn f32_bytes(v: &[f32]) -> Bytes {
    ibex_proto::tensor::f32_to_le_bytes(v)
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
            let r = req.into_inner();
            self.shard.wait_for(r.step).await?;
            let (step, vals) = self.shard.read(&r.names)?;
            Ok(pb::PullResponse {
                step,
                values: self.tensors(vals),
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
            let (_, names) = self.do_push(req).await?;
            // Sync: the values after step `step`; async: the values right after this push.
            self.shard.wait_for(step + 1).await?;
            let (now, vals) = self.shard.read(&names)?;
            Ok(pb::PullResponse {
                step: now,
                values: self.tensors(vals),
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
            let (dim, v) = self.shard.lookup(&r.table, &r.ids)?;
            let rows = self
                .tensors(vec![(r.table, vec![r.ids.len(), dim], v)])
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
            let (dim, _) = self.shard.lookup(&r.table, &[])?;
            let values = self
                .values(peer.as_ref(), &t, (r.ids.len() * dim) as u64)
                .await?;
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
            let (step, path) = self.shard.save()?;
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
            let step = self.shard.restore(req.into_inner().step)?;
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
