//! The [`Worker`]: connections to every PS, the variable placement, and the calls that fan
//! out one request per PS concurrently and reassemble the answers in the caller's order.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::future::try_join_all;
use ibex_proto::ps::MAX_MESSAGE;
use ibex_proto::ps::v1::parameter_server_ibex::ParameterServerClient;
use ibex_transport::grpc::{Channel, Endpoint};
use ibex_transport::{Config, RecvBuf, RemoteBuf};

use crate::error::WorkerError;
use crate::pb;
use crate::placement::{Part, Placement, place};
use crate::profile::{CommProfile, Path};
use crate::spec::{ClusterSpec, Timeouts};
use crate::types::VarSpec;

/// What sets each deadline, as deadline errors name it.
const CALL_SETTING: &str = "call_timeout_secs in the cluster spec (ClusterSpec::timeouts.call)";
const CONNECT_SETTING: &str =
    "connect_timeout_secs in the cluster spec (ClusterSpec::timeouts.connect)";

/// Tensor bytes one request body carries at most (a larger tensor travels alone). A pull
/// or push of a whole model goes as several concurrent requests per PS: each side's
/// encoding, transfer and decoding overlap, and the codec's body buffers stay below
/// glibc's 32 MiB mmap ceiling, so freed ones are reused instead of being mapped fresh
/// (a page fault per 4 KiB) every step.
pub(crate) const BATCH_BYTES: usize = 4 << 20;

/// Items grouped into batches of about [`BATCH_BYTES`], in order.
pub(crate) struct Batches<T> {
    pub(crate) done: Vec<Vec<T>>,
    bytes: usize,
}

impl<T> Default for Batches<T> {
    fn default() -> Self {
        Batches {
            done: Vec::new(),
            bytes: 0,
        }
    }
}

impl<T> Batches<T> {
    /// Adds `item` of `bytes` body bytes, starting a new batch when it would overflow.
    pub(crate) fn add(&mut self, item: T, bytes: usize) {
        match self.done.last_mut() {
            Some(b) if self.bytes + bytes <= BATCH_BYTES => b.push(item),
            _ => {
                self.done.push(vec![item]);
                self.bytes = 0;
            }
        }
        self.bytes += bytes;
    }
}

/// One PS: the generated client and its channel (Ibex, or stock HTTP/2 for `grpc`
/// clusters: `Channel::connect_any` gives one type for both).
#[derive(Clone)]
pub(crate) struct Client {
    pub(crate) rpc: ParameterServerClient<Channel>,
    pub(crate) ch: Channel,
    /// The PS's address, for errors.
    pub(crate) uri: String,
}

impl Client {
    /// The channel where it is an Ibex one (registered memory, one-sided reads).
    pub(crate) fn ibex(&self) -> Option<&Channel> {
        self.ch.is_ibex().then_some(&self.ch)
    }
}

/// A training task's handle on the parameter servers.
pub struct Worker {
    pub(crate) index: u32,
    pub(crate) clients: Vec<Client>,
    timeouts: Timeouts,
    state: Mutex<State>,
    profile: Mutex<CommProfile>,
    /// Registered gradient buffers per variable (see `staging`).
    pub(crate) staging: crate::staging::Cache,
    /// Per PS: leases of pull replies this worker has read, named in its next request to
    /// that PS so the PS lets their snapshots go (see docs/ps.md, "Pulls as descriptors").
    released: Vec<Mutex<Vec<u64>>>,
}

#[derive(Default)]
struct State {
    vars: HashMap<String, Placement>,
    load: Vec<usize>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("index", &self.index)
            .field("num_ps", &self.clients.len())
            .finish()
    }
}

impl Worker {
    /// Connects to every PS of `spec` over its transport with the settings of `config`
    /// (binaries pass [`crate::transport_config`], the job environment's), retrying each
    /// while it starts for up to `spec.timeouts.connect`. Every later call to a PS has the
    /// deadline `spec.timeouts.call`, and the connections ping the PS
    /// (`spec.timeouts.keepalive`).
    pub async fn connect(
        spec: &ClusterSpec,
        worker_index: usize,
        config: &Config,
    ) -> Result<Worker, WorkerError> {
        if spec.ps.is_empty() {
            return Err(WorkerError::Usage("the cluster spec lists no PS".into()));
        }
        let index = u32::try_from(worker_index)
            .map_err(|_| WorkerError::Usage("worker index too large".into()))?;
        let timeouts = spec.timeouts;
        let clients = try_join_all(
            (0..spec.ps.len()).map(|i| connect_one(i, spec.ps_uri(i), config, timeouts)),
        )
        .await?;
        let load = vec![0; clients.len()];
        Ok(Worker {
            index,
            clients,
            timeouts,
            state: Mutex::new(State {
                vars: HashMap::new(),
                load,
            }),
            profile: Mutex::new(CommProfile::default()),
            staging: Default::default(),
            released: (0..spec.ps.len()).map(|_| Mutex::new(Vec::new())).collect(),
        })
    }

    /// Number of PS shards.
    pub fn num_ps(&self) -> usize {
        self.clients.len()
    }

    /// The bounds this worker's calls run under (from its spec).
    pub fn timeouts(&self) -> Timeouts {
        self.timeouts
    }

    /// One call to PS `ps` under the call deadline: the PS is told it (`grpc-timeout`), and
    /// the worker gives up at it whatever the PS does, so a PS that never answers costs at
    /// most the deadline. `f` makes the call on a clone of the PS's client.
    pub(crate) async fn call<Q, R, F, Fut>(
        &self,
        ps: usize,
        method: &'static str,
        msg: Q,
        f: F,
    ) -> Result<R, WorkerError>
    where
        F: FnOnce(ParameterServerClient<Channel>, tonic::Request<Q>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<R>, tonic::Status>>,
    {
        self.count(method);
        let limit = self.timeouts.call;
        let mut req = tonic::Request::new(msg);
        req.set_timeout(limit);
        let t0 = Instant::now();
        match tokio::time::timeout(limit, f(self.clients[ps].rpc.clone(), req)).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            // The channel (or the PS) enforcing the same deadline; a PS's own sync timeout
            // comes earlier and keeps its message, which names the missing workers.
            Ok(Err(s))
                if s.code() == tonic::Code::DeadlineExceeded
                    && t0.elapsed() >= limit.mul_f64(0.95) =>
            {
                Err(self.deadline(ps, method, limit))
            }
            // Every call follows a connect that succeeded: a PS that cannot be reached now
            // was there and went away (killed, crashed, or its host is gone).
            Ok(Err(s)) if s.code() == tonic::Code::Unavailable => Err(WorkerError::Unavailable {
                ps,
                source: format!(
                    "the PS at {} went away ({method} failed: {})",
                    self.clients[ps].uri,
                    s.message()
                )
                .into(),
            }),
            Ok(Err(s)) => Err(WorkerError::from_status(ps, s)),
            Err(_) => Err(self.deadline(ps, method, limit)),
        }
    }

    fn deadline(&self, ps: usize, call: &str, after: Duration) -> WorkerError {
        WorkerError::Deadline {
            ps,
            server: self.clients[ps].uri.clone(),
            call: call.to_string(),
            after,
            setting: CALL_SETTING,
        }
    }

    /// Where `name` lives, once created.
    pub fn placement(&self, name: &str) -> Option<Placement> {
        self.lock_state().vars.get(name).cloned()
    }

    /// Places `vars` (greedy by bytes, large ones split along dim 0) and creates them on
    /// their PS. Every worker must call it with the same list in the same order; creating
    /// an identical variable again is a no-op, a different one under the same name an error.
    pub async fn create_variables(&self, vars: &[VarSpec]) -> Result<(), WorkerError> {
        let placements = {
            let mut st = self.lock_state();
            let mut fresh = Vec::new();
            for v in vars {
                match st.vars.get(&v.name) {
                    Some(p) if p.spec == *v => {}
                    Some(_) => {
                        return Err(WorkerError::Usage(format!(
                            "variable {:?} was already created with a different spec",
                            v.name
                        )));
                    }
                    None if fresh.iter().any(|f: &VarSpec| f.name == v.name) => {
                        return Err(WorkerError::Usage(format!(
                            "variable {:?} is listed twice",
                            v.name
                        )));
                    }
                    None => fresh.push(v.clone()),
                }
            }
            let placed = place(&fresh, &mut st.load);
            for p in &placed {
                st.vars.insert(p.spec.name.clone(), p.clone());
            }
            placed
        };
        let mut per_ps: Vec<Vec<pb::VariableDef>> = vec![Vec::new(); self.clients.len()];
        for p in &placements {
            for part in &p.parts {
                per_ps[part.ps].push(pb::VariableDef {
                    name: part.name.clone(),
                    dtype: p.spec.dtype.to_pb() as i32,
                    shape: p.part_shape(part).iter().map(|&d| d as u64).collect(),
                    init: Some(p.spec.init.to_pb()),
                    optimizer: Some(p.spec.optimizer.to_pb()),
                    sparse: p.spec.sparse,
                    full_shape: p.spec.shape.iter().map(|&d| d as u64).collect(),
                    row_offset: part.row_offset as u64,
                });
            }
        }
        try_join_all(
            per_ps
                .into_iter()
                .enumerate()
                .filter(|(_, v)| !v.is_empty())
                .map(|(ps, vars)| {
                    self.call(
                        ps,
                        "CreateVariables",
                        pb::CreateVariablesRequest { vars },
                        |mut c, r| async move { c.create_variables(r).await },
                    )
                }),
        )
        .await?;
        Ok(())
    }

    /// Values of `names` after `step` steps have been applied (sync mode waits for them;
    /// async mode returns the current values).
    pub async fn pull(&self, names: &[&str], step: u64) -> Result<Vec<Vec<f32>>, WorkerError> {
        let mut out = vec![Vec::new(); names.len()];
        self.pull_into(names, step, &mut out).await?;
        Ok(out)
    }

    /// As [`Worker::pull`], into the caller's vectors (`out[i]` for `names[i]`), which are
    /// resized to each variable's element count and overwritten: a training loop that
    /// passes the same vectors every step decodes into the same memory, with no
    /// allocation.
    pub async fn pull_into(
        &self,
        names: &[&str],
        step: u64,
        out: &mut [Vec<f32>],
    ) -> Result<(), WorkerError> {
        check_out(names.len(), out)?;
        self.pull_out(names, step, Out::Vecs(out)).await
    }

    /// As [`Worker::pull_into`], straight into caller memory (`out[i]` for `names[i]`, each
    /// exactly the variable's element count): the one-sided read of a remote part lands in
    /// it, with no copy on the worker after. A parameter tensor the framework computes
    /// with can be pulled in place this way.
    pub async fn pull_into_bufs(
        &self,
        names: &[&str],
        step: u64,
        out: &[OutBuf],
    ) -> Result<(), WorkerError> {
        check_bufs(self, names.iter().copied(), out)?;
        self.pull_out(names, step, Out::Bufs(out)).await
    }

    async fn pull_out(&self, names: &[&str], step: u64, out: Out<'_>) -> Result<(), WorkerError> {
        let places = self.lookup(names.iter().copied())?;
        let mut per_ps: Vec<Batches<String>> = (0..self.clients.len())
            .map(|_| Batches::default())
            .collect();
        for p in &places {
            let row = p.row_len();
            for part in &p.parts {
                per_ps[part.ps].add(part.name.clone(), part.rows * row * 4);
            }
        }
        let worker = self.index;
        let replies = try_join_all(
            per_ps
                .into_iter()
                .enumerate()
                .flat_map(|(ps, b)| b.done.into_iter().map(move |names| (ps, names)))
                .map(|(ps, names)| async move {
                    let req = pb::PullRequest {
                        names,
                        step,
                        worker,
                        release: self.take_released(ps),
                    };
                    let r = self
                        .call(ps, "Pull", req, |mut c, r| async move { c.pull(r).await })
                        .await?;
                    Ok::<_, WorkerError>(r.values)
                }),
        )
        .await?;
        self.assemble_out(&places, replies.into_iter().flatten(), out)
            .await
    }

    /// Contributes gradients to `step`. Returns once every PS has accepted them (sync mode:
    /// before the step is applied). Each gradient is copied once, into this worker's reused
    /// registered buffer for its variable (see [`Worker::stage`]), and sent from there;
    /// writing into a [`crate::Staged`] lease instead saves that copy. Waits while an earlier
    /// push of the same variable is still in flight.
    pub async fn push(&self, step: u64, grads: &[(&str, &[f32])]) -> Result<(), WorkerError> {
        let staged = self.stage_slices(grads).await?;
        self.push_staged(step, staged).await
    }

    /// Sends one PS's push (or push-pull, returning its fresh values); the exposed buffers
    /// live until the call returned, since the PS reads them during the call.
    pub(crate) async fn send_one(
        &self,
        (ps, req, keep): PushReq,
        pull: bool,
    ) -> Result<Vec<pb::Tensor>, WorkerError> {
        let (step, worker) = (req.step, req.worker);
        let names: Vec<String> = req.grads.iter().map(|g| g.name.clone()).collect();
        let values = if pull {
            self.call(ps, "PushPull", req, |mut c, r| async move {
                c.push_pull(r).await
            })
            .await
            .map(|r| r.values)
        } else {
            self.call(ps, "Push", req, |mut c, r| async move { c.push(r).await })
                .await
                .map(|_| Vec::new())
        };
        drop(keep);
        values.map_err(|e| e.pushed_twice(worker, step, &names))
    }

    /// Pushes `grads` for `step`, waits until the step is applied, and returns the fresh
    /// values of the same variables, in the same order: one round trip per PS. Gradients
    /// take the same path as in [`Worker::push`].
    pub async fn push_pull(
        &self,
        step: u64,
        grads: &[(&str, &[f32])],
    ) -> Result<Vec<Vec<f32>>, WorkerError> {
        let mut out = vec![Vec::new(); grads.len()];
        self.push_pull_into(step, grads, &mut out).await?;
        Ok(out)
    }

    /// As [`Worker::push_pull`], with the fresh values written into the caller's vectors
    /// as [`Worker::pull_into`] does.
    pub async fn push_pull_into(
        &self,
        step: u64,
        grads: &[(&str, &[f32])],
        out: &mut [Vec<f32>],
    ) -> Result<(), WorkerError> {
        check_out(grads.len(), out)?;
        let staged = self.stage_slices(grads).await?;
        self.push_staged_into(step, staged, Some(out)).await
    }

    /// As [`Worker::push_pull`], with the fresh values read straight into caller memory
    /// (`out[i]` for `grads[i]`), as [`Worker::pull_into_bufs`] does.
    pub async fn push_pull_into_bufs(
        &self,
        step: u64,
        grads: &[(&str, &[f32])],
        out: &[OutBuf],
    ) -> Result<(), WorkerError> {
        check_bufs(self, grads.iter().map(|(n, _)| *n), out)?;
        let staged = self.stage_slices(grads).await?;
        self.push_pull_staged_into_bufs(step, staged, out).await
    }

    /// Rows `ids` of sparse table `table`, concatenated (`ids.len() * dim` values).
    pub async fn lookup_rows(&self, table: &str, ids: &[u64]) -> Result<Vec<f32>, WorkerError> {
        let p = self.table(table)?;
        let dim = p.row_len();
        let split = split_ids(&p, ids)?;
        let replies = try_join_all(
            split
                .iter()
                .enumerate()
                .filter(|(_, (_, ids))| !ids.is_empty())
                .map(|(k, (_, local))| {
                    let part = &p.parts[k];
                    async move {
                        let req = pb::LookupRowsRequest {
                            table: part.name.clone(),
                            ids: local.clone(),
                        };
                        let r = self
                            .call(part.ps, "LookupRows", req, |mut c, r| async move {
                                c.lookup_rows(r).await
                            })
                            .await?;
                        let t = r
                            .rows
                            .ok_or_else(|| malformed(part.ps, "LookupRows reply has no rows"))?;
                        Ok::<_, WorkerError>((k, self.decode(part.ps, &t)?))
                    }
                }),
        )
        .await?;
        let mut out = vec![0f32; ids.len() * dim];
        for (k, rows) in replies {
            let positions = &split[k].0;
            if rows.len() != positions.len() * dim {
                return Err(malformed(
                    p.parts[k].ps,
                    "LookupRows reply has the wrong number of values",
                ));
            }
            for (j, &pos) in positions.iter().enumerate() {
                out[pos * dim..(pos + 1) * dim].copy_from_slice(&rows[j * dim..(j + 1) * dim]);
            }
        }
        Ok(out)
    }

    /// Row gradients (`ids.len() * dim` values) for sparse table `table` at `step`. In sync
    /// mode every worker must push every table each step (an empty `ids` is allowed).
    pub async fn push_sparse(
        &self,
        step: u64,
        table: &str,
        ids: &[u64],
        grads: &[f32],
    ) -> Result<(), WorkerError> {
        let p = self.table(table)?;
        let dim = p.row_len();
        if grads.len() != ids.len() * dim {
            return Err(WorkerError::ShapeMismatch {
                name: table.into(),
                expected: ids.len() * dim,
                got: grads.len(),
            });
        }
        let split = split_ids(&p, ids)?;
        let worker = self.index;
        // Every part takes part in the step, even with no rows, so sync steps complete.
        try_join_all(
            split
                .into_iter()
                .enumerate()
                .map(|(k, (positions, local))| {
                    let part = &p.parts[k];
                    let mut g = Vec::with_capacity(positions.len() * dim);
                    for &pos in &positions {
                        g.extend_from_slice(&grads[pos * dim..(pos + 1) * dim]);
                    }
                    async move {
                        let t = self
                            .tensor(part.ps, &part.name, vec![local.len(), dim], &g)
                            .await?;
                        let req = pb::PushSparseRequest {
                            step,
                            worker,
                            table: part.name.clone(),
                            ids: local,
                            grads: Some(t.0),
                        };
                        let r = self
                            .call(part.ps, "PushSparse", req, |mut c, r| async move {
                                c.push_sparse(r).await
                            })
                            .await;
                        drop(t.1);
                        r
                    }
                }),
        )
        .await?;
        Ok(())
    }

    /// Steps applied so far, as all PS agree; an error if they disagree (run `recover`).
    pub async fn current_step(&self) -> Result<u64, WorkerError> {
        let stats = self.stats().await?;
        let first = stats[0].step;
        if let Some(s) = stats.iter().find(|s| s.step != first) {
            return Err(WorkerError::Usage(format!(
                "PS disagree on the step (PS 0 at {first}, PS {} at {}): call recover()",
                s.shard, s.step
            )));
        }
        Ok(first)
    }

    /// After a PS restart: finds the newest checkpoint step every PS holds, restores every
    /// PS to it, and returns it. Training continues with `push(step, ..)`.
    pub async fn recover(&self) -> Result<u64, WorkerError> {
        let stats = self.stats().await?;
        let mut common: Option<Vec<u64>> = None;
        for s in &stats {
            common = Some(match common {
                None => s.checkpoint_steps.clone(),
                Some(c) => c
                    .into_iter()
                    .filter(|x| s.checkpoint_steps.contains(x))
                    .collect(),
            });
        }
        let Some(step) = common.unwrap_or_default().into_iter().max() else {
            let have: Vec<String> = stats
                .iter()
                .map(|s| format!("PS {}: {:?}", s.shard, s.checkpoint_steps))
                .collect();
            return Err(WorkerError::Usage(format!(
                "no checkpoint step is held by every PS ({}); cannot recover",
                have.join(", ")
            )));
        };
        try_join_all((0..self.clients.len()).map(|ps| {
            self.call(
                ps,
                "Restore",
                pb::RestoreRequest { step },
                |mut c, r| async move { c.restore(r).await },
            )
        }))
        .await?;
        Ok(step)
    }

    /// Every PS's `Stats`, in PS order.
    pub async fn stats(&self) -> Result<Vec<pb::StatsResponse>, WorkerError> {
        try_join_all((0..self.clients.len()).map(|ps| {
            self.call(ps, "Stats", pb::StatsRequest {}, |mut c, r| async move {
                c.stats(r).await
            })
        }))
        .await
    }

    /// Asks every PS to write a checkpoint now; returns their steps.
    pub async fn save(&self) -> Result<Vec<u64>, WorkerError> {
        try_join_all((0..self.clients.len()).map(|ps| async move {
            let r = self
                .call(ps, "Save", pb::SaveRequest {}, |mut c, r| async move {
                    c.save(r).await
                })
                .await?;
            Ok::<_, WorkerError>(r.step)
        }))
        .await
    }

    /// What this worker sent and received so far.
    pub fn comm_profile(&self) -> CommProfile {
        let mut p = self.profile.lock().map(|p| p.clone()).unwrap_or_default();
        p.transport = self
            .clients
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.ch.connection().map(|conn| (i, conn.stats())))
            .collect();
        p
    }

    fn lock_state(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic elsewhere cannot leave the map half-updated (inserts are single calls).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn count(&self, method: &'static str) {
        if let Ok(mut p) = self.profile.lock() {
            p.record_rpc(method);
        }
    }

    pub(crate) fn lookup<'a>(
        &self,
        names: impl Iterator<Item = &'a str>,
    ) -> Result<Vec<Placement>, WorkerError> {
        let st = self.lock_state();
        names
            .map(|n| {
                st.vars
                    .get(n)
                    .cloned()
                    .ok_or_else(|| WorkerError::UnknownVariable {
                        name: n.to_string(),
                    })
            })
            .collect()
    }

    fn table(&self, name: &str) -> Result<Placement, WorkerError> {
        let p = self.lookup(std::iter::once(name))?.remove(0);
        if !p.spec.sparse {
            return Err(WorkerError::Usage(format!(
                "{name:?} is a dense variable, not a sparse table"
            )));
        }
        Ok(p)
    }

    /// Encodes `values` for PS `ps`: inline, or exposed for a one-sided read when large and
    /// the channel reads one-sided.
    async fn tensor(
        &self,
        ps: usize,
        name: &str,
        shape: Vec<usize>,
        values: &[f32],
    ) -> Result<(pb::Tensor, Option<RemoteBuf>), WorkerError> {
        self.tensor_from_bytes(ps, name, shape, f32_to_bytes(values))
            .await
    }

    /// As [`Worker::tensor`], for little-endian f32 bytes the caller already holds.
    pub(crate) async fn tensor_from_bytes(
        &self,
        ps: usize,
        name: &str,
        shape: Vec<usize>,
        bytes: Bytes,
    ) -> Result<(pb::Tensor, Option<RemoteBuf>), WorkerError> {
        let len = bytes.len();
        let mut t = pb::Tensor {
            name: name.to_string(),
            dtype: pb::Dtype::F32 as i32,
            shape: shape.iter().map(|&d| d as u64).collect(),
            data: None,
        };
        let mut keep = None;
        match &self.clients[ps] {
            // The threshold comes from the connection (`Channel::remote_min`), as the PS's
            // for its pull replies.
            c if c.ch.remote_min().is_some_and(|min| len >= min) => {
                let remote = c.ch.expose(bytes).await?;
                t.data = Some(pb::tensor::Data::Remote(pb::RemoteRef {
                    descriptor: remote.descriptor(),
                    len: len as u64,
                    lease: 0,
                }));
                keep = Some(remote);
                self.record(Path::Remote, len);
            }
            _ => {
                t.data = Some(pb::tensor::Data::Inline(bytes));
                self.record(Path::Inline, len);
            }
        }
        Ok((t, keep))
    }

    fn record(&self, path: Path, len: usize) {
        if let Ok(mut p) = self.profile.lock() {
            p.record_sent(path, len as u64);
        }
    }

    fn decode(&self, ps: usize, t: &pb::Tensor) -> Result<Vec<f32>, WorkerError> {
        Ok(ibex_proto::tensor::f32_from_le_bytes(
            self.f32_bytes(ps, t)?,
        ))
    }

    /// The inline f32 bytes of a reply tensor, counted in the profile.
    fn f32_bytes<'t>(&self, ps: usize, t: &'t pb::Tensor) -> Result<&'t [u8], WorkerError> {
        let Some(pb::tensor::Data::Inline(b)) = &t.data else {
            return Err(malformed(
                ps,
                &format!("tensor {:?} in a reply is not inline", t.name),
            ));
        };
        if t.dtype != pb::Dtype::F32 as i32 || b.len() % 4 != 0 {
            return Err(malformed(
                ps,
                &format!("tensor {:?} in a reply is not f32", t.name),
            ));
        }
        if let Ok(mut p) = self.profile.lock() {
            p.record_received(b.len() as u64);
        }
        Ok(b)
    }

    /// The leases of PS `ps`'s pull replies read since the last request to it; the caller
    /// puts them in its request's `release`.
    pub(crate) fn take_released(&self, ps: usize) -> Vec<u64> {
        match self.released.get(ps).map(|m| m.lock()) {
            Some(Ok(mut v)) => std::mem::take(&mut *v),
            _ => Vec::new(),
        }
    }

    /// Writes whole variables (in `places` order) into `out` from the parts in `values`:
    /// each vector is resized to its variable and overwritten (an [`OutBuf`] must already
    /// have its size), one copy per value (the decode of an inline part, or the one-sided
    /// read of a remote one, straight into the destination). Every lease in `values` is
    /// queued for release once this returns, read or not, but never earlier: the PS must
    /// keep a snapshot until its read has finished.
    pub(crate) async fn assemble_out(
        &self,
        places: &[Placement],
        values: impl Iterator<Item = pb::Tensor>,
        out: Out<'_>,
    ) -> Result<(), WorkerError> {
        let mut by_name: HashMap<String, pb::Tensor> = HashMap::new();
        let mut leases: Vec<(usize, u64)> = Vec::new();
        for t in values {
            if let Some(pb::tensor::Data::Remote(r)) = &t.data
                && r.lease != 0
            {
                // Which PS sent it is known only through the placement; unknown names are
                // released nowhere (the PS's timeout ends them).
                if let Some(ps) = self.ps_of_part(places, &t.name) {
                    leases.push((ps, r.lease));
                }
            }
            by_name.insert(t.name.clone(), t);
        }
        let r = self.assemble_parts(places, by_name, out).await;
        for (ps, lease) in leases {
            if let Some(Ok(mut v)) = self.released.get(ps).map(|m| m.lock()) {
                v.push(lease);
            }
        }
        r
    }

    fn ps_of_part(&self, places: &[Placement], name: &str) -> Option<usize> {
        places
            .iter()
            .flat_map(|p| &p.parts)
            .find(|part| part.name == name)
            .map(|part| part.ps)
    }

    async fn assemble_parts(
        &self,
        places: &[Placement],
        mut by_name: HashMap<String, pb::Tensor>,
        out: Out<'_>,
    ) -> Result<(), WorkerError> {
        let dests: Vec<Dest<'_>> = match out {
            Out::Vecs(v) => v.iter_mut().map(Dest::Vec).collect(),
            Out::Bufs(b) => b.iter().map(Dest::Buf).collect(),
        };
        // Every part is matched and its size checked before anything is read.
        let mut jobs = Vec::with_capacity(places.len());
        for (p, o) in places.iter().zip(dests) {
            let row = p.row_len();
            let numel = p.spec.numel();
            let mut parts = Vec::with_capacity(p.parts.len());
            let mut at = 0usize;
            for part in &p.parts {
                let t = by_name
                    .remove(&part.name)
                    .ok_or_else(|| malformed(part.ps, &format!("reply lacks {:?}", part.name)))?;
                let n = part.rows * row;
                if at + n > numel {
                    return Err(malformed(
                        part.ps,
                        &format!("{:?} has more values than its variable", part.name),
                    ));
                }
                parts.push((part.ps, at, n, t));
                at += n;
            }
            if let Dest::Buf(b) = &o
                && b.len != numel
            {
                return Err(WorkerError::Usage(format!(
                    "the output buffer for {:?} holds {} values, the variable {numel}",
                    p.spec.name, b.len
                )));
            }
            jobs.push((o, numel, parts));
        }
        try_join_all(
            jobs.into_iter()
                .map(|(o, numel, parts)| self.fill(o, numel, parts)),
        )
        .await?;
        Ok(())
    }

    /// Fills one variable's memory from its parts; remote parts are read one after another
    /// (each read owns the destination while it runs), variables run concurrently.
    async fn fill(
        &self,
        o: Dest<'_>,
        numel: usize,
        parts: Vec<(usize, usize, usize, pb::Tensor)>,
    ) -> Result<(), WorkerError> {
        let o = match o {
            Dest::Vec(v) => {
                v.resize(numel, 0.0);
                DestMem::Vec(v)
            }
            Dest::Buf(b) => DestMem::Buf(b),
        };
        let mut o = o;
        for (ps, at, n, t) in parts {
            match &t.data {
                Some(pb::tensor::Data::Remote(r)) => {
                    self.check_remote(ps, at, n, numel, &t, r)?;
                    if n == 0 {
                        continue;
                    }
                    match &mut o {
                        DestMem::Vec(v) => {
                            let mut b = Box::new(std::mem::take(&mut **v));
                            // SAFETY: `at + n <= b.len()` (check_remote), so `ptr..ptr + n * 4`
                            // lies in the vector's initialised heap memory. The box handed to
                            // the RecvBuf owns the vector and keeps that memory alive and in
                            // place (moving a Box or a Vec does not move the heap buffer) and
                            // unaliased until the RecvBuf gives it back, even if this future
                            // is dropped mid-read. Any bit pattern is a valid f32.
                            let dst = unsafe {
                                let ptr = b.as_mut_ptr().add(at).cast::<u8>();
                                RecvBuf::from_raw(ptr, n * 4, b)
                            };
                            let read = self.read_part(ps, &t, r, dst).await?;
                            let back = read.into_owner().downcast::<Vec<f32>>().map_err(|_| {
                                malformed(ps, "the transport returned a different receive buffer")
                            })?;
                            **v = *back;
                        }
                        DestMem::Buf(b) => {
                            // SAFETY: `at + n <= numel == b.len` (checked above and in
                            // assemble_parts); the OutBuf's contract keeps `ptr..ptr + len`
                            // valid for writes while its owner lives, and the RecvBuf holds a
                            // clone of that owner, so the memory outlives the read even if
                            // this future is dropped mid-read.
                            let dst = unsafe {
                                RecvBuf::from_raw(
                                    b.ptr.add(at).cast::<u8>(),
                                    n * 4,
                                    Box::new(b.owner.clone()),
                                )
                            };
                            drop(self.read_part(ps, &t, r, dst).await?);
                        }
                    }
                    #[cfg(target_endian = "big")]
                    for x in o.slice_mut(at, n) {
                        *x = f32::from_bits(u32::from_le(x.to_bits()));
                    }
                    if let Ok(mut p) = self.profile.lock() {
                        p.record_received(r.len);
                    }
                }
                _ => {
                    let b = self.f32_bytes(ps, &t)?;
                    if b.len() != n * 4 {
                        return Err(malformed(
                            ps,
                            &format!("{:?} has {} values, expected {n}", t.name, b.len() / 4),
                        ));
                    }
                    ibex_proto::tensor::f32_from_le_into(o.slice_mut(at, n), b);
                }
            }
        }
        Ok(())
    }

    /// A remote part's dtype and length must match its place in the variable, so a hostile
    /// PS cannot make the worker read past the part.
    fn check_remote(
        &self,
        ps: usize,
        at: usize,
        n: usize,
        numel: usize,
        t: &pb::Tensor,
        r: &pb::RemoteRef,
    ) -> Result<(), WorkerError> {
        if t.dtype != pb::Dtype::F32 as i32 {
            return Err(malformed(
                ps,
                &format!("tensor {:?} in a reply is not f32", t.name),
            ));
        }
        if Some(r.len) != (n as u64).checked_mul(4) {
            return Err(malformed(
                ps,
                &format!(
                    "remote tensor {:?} is {} B, its part of the variable holds {} B ({n} f32)",
                    t.name,
                    r.len,
                    n * 4
                ),
            ));
        }
        if at + n > numel {
            return Err(malformed(
                ps,
                &format!("{:?} has more values than its variable", t.name),
            ));
        }
        Ok(())
    }

    /// Reads the PS's exposed snapshot of one part into `dst`: the one copy of these bytes
    /// on the worker. Returns the buffer once the read is complete.
    async fn read_part(
        &self,
        ps: usize,
        t: &pb::Tensor,
        r: &pb::RemoteRef,
        dst: RecvBuf,
    ) -> Result<RecvBuf, WorkerError> {
        let conn = self.clients[ps].ch.connection().ok_or_else(|| {
            malformed(
                ps,
                &format!(
                    "tensor {:?} is a remote buffer, but this channel cannot read one",
                    t.name
                ),
            )
        })?;
        // The read is bounded like a call: a PS that stops serving it mid-way costs the
        // deadline, not a hang.
        let limit = self.timeouts.call;
        tokio::time::timeout(limit, conn.read_remote(r.descriptor.clone(), dst))
            .await
            .map_err(|_| {
                self.deadline(
                    ps,
                    &format!("the read of pulled tensor {:?}", t.name),
                    limit,
                )
            })?
            .map_err(|e| WorkerError::Unavailable {
                ps,
                source: format!(
                    "the PS at {} went away while its pulled tensor {:?} was read: {e}",
                    self.clients[ps].uri, t.name
                )
                .into(),
            })
    }
}

/// Where pulled values go: the caller's vectors, or caller memory.
pub(crate) enum Out<'a> {
    Vecs(&'a mut [Vec<f32>]),
    Bufs(&'a [OutBuf]),
}

enum Dest<'a> {
    Vec(&'a mut Vec<f32>),
    Buf(&'a OutBuf),
}

enum DestMem<'a> {
    Vec(&'a mut Vec<f32>),
    Buf(&'a OutBuf),
}

impl DestMem<'_> {
    /// Values `at..at + n`, which the caller has checked lie in the destination.
    fn slice_mut(&mut self, at: usize, n: usize) -> &mut [f32] {
        match self {
            DestMem::Vec(v) => &mut v[at..at + n],
            DestMem::Buf(b) => {
                assert!(at + n <= b.len, "a part past the end of its output buffer");
                // SAFETY: in bounds (asserted); OutBuf's contract makes the memory valid for
                // writes while its owner (held by `b`) lives, and gives this pull the only
                // writer's access while it runs.
                unsafe { std::slice::from_raw_parts_mut(b.ptr.add(at), n) }
            }
        }
    }
}

/// Caller memory that pulled values are written into in place: a framework's tensor, a
/// NumPy array. `owner` keeps it alive: a one-sided read in flight holds a clone of it, so
/// even a pull dropped mid-read never writes freed memory.
pub struct OutBuf {
    ptr: *mut f32,
    len: usize,
    owner: std::sync::Arc<dyn std::any::Any + Send + Sync>,
}

// SAFETY: the memory is kept alive by `owner` (Send + Sync); it is written only by pulls,
// under the contract of `OutBuf::from_raw`.
unsafe impl Send for OutBuf {}
// SAFETY: shared access reads only `ptr`/`len`.
unsafe impl Sync for OutBuf {}

impl std::fmt::Debug for OutBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutBuf").field("len", &self.len).finish()
    }
}

impl OutBuf {
    /// `len` f32 at `ptr`, kept alive by `owner`.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be valid for writes and stay valid and in place while `owner`
    /// lives, and no one may write it while a pull into it runs. Readers during a pull
    /// (or after one that was dropped mid-way) see unspecified values.
    pub unsafe fn from_raw(
        ptr: *mut f32,
        len: usize,
        owner: std::sync::Arc<dyn std::any::Any + Send + Sync>,
    ) -> OutBuf {
        OutBuf { ptr, len, owner }
    }

    /// Number of f32 values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// `out` must hold one buffer per name, each of its variable's element count.
pub(crate) fn check_bufs<'a>(
    w: &Worker,
    names: impl ExactSizeIterator<Item = &'a str>,
    out: &[OutBuf],
) -> Result<(), WorkerError> {
    if names.len() != out.len() {
        return Err(WorkerError::Usage(format!(
            "{} variables but {} output buffers: pass one per variable",
            names.len(),
            out.len()
        )));
    }
    for (name, b) in names.zip(out) {
        let p = w
            .placement(name)
            .ok_or_else(|| WorkerError::UnknownVariable { name: name.into() })?;
        if b.len != p.spec.numel() {
            return Err(WorkerError::ShapeMismatch {
                name: name.into(),
                expected: p.spec.numel(),
                got: b.len,
            });
        }
    }
    Ok(())
}

/// `out` must hold one vector per name.
fn check_out(names: usize, out: &[Vec<f32>]) -> Result<(), WorkerError> {
    if out.len() != names {
        return Err(WorkerError::Usage(format!(
            "{names} variables asked for but {} output vectors given: pass one per name",
            out.len()
        )));
    }
    Ok(())
}

fn malformed(ps: usize, what: &str) -> WorkerError {
    WorkerError::Rpc {
        ps,
        code: tonic::Code::Internal,
        message: format!("malformed reply: {what}"),
    }
}

/// One PS's push request, with the exposed buffers that must outlive the call.
pub(crate) type PushReq = (usize, pb::PushRequest, Vec<RemoteBuf>);

/// For one part of a table: positions in the caller's `ids` it serves, and their part-local ids.
type PartIds = (Vec<usize>, Vec<u64>);

/// Splits `ids` by the part of the table that holds each.
fn split_ids(p: &Placement, ids: &[u64]) -> Result<Vec<PartIds>, WorkerError> {
    let rows = p.spec.shape.first().copied().unwrap_or(0) as u64;
    let mut out: Vec<PartIds> = vec![Default::default(); p.parts.len()];
    for (pos, &id) in ids.iter().enumerate() {
        if id >= rows {
            return Err(WorkerError::Rejected {
                ps: p.parts.first().map(|x| x.ps).unwrap_or(0),
                code: tonic::Code::OutOfRange,
                message: format!(
                    "id {id} is out of range for table {:?} with {rows} rows",
                    p.spec.name
                ),
            });
        }
        let k = p
            .parts
            .partition_point(|part: &Part| (part.row_offset as u64) <= id)
            - 1;
        out[k].0.push(pos);
        out[k].1.push(id - p.parts[k].row_offset as u64);
    }
    Ok(out)
}

pub(crate) fn f32_to_bytes(v: &[f32]) -> Bytes {
    ibex_proto::tensor::f32_to_le_bytes(v)
}

/// Connects to PS `ps` at `uri`: an Ibex address, or `http://` for a `grpc` cluster. A PS
/// that is not up yet is retried until `t.connect` has passed; each attempt is bounded by
/// what is left of it, so one that hangs (a peer that accepts and never answers) ends too.
async fn connect_one(
    ps: usize,
    uri: String,
    config: &Config,
    t: Timeouts,
) -> Result<Client, WorkerError> {
    let deadline = Instant::now() + t.connect;
    let endpoint = endpoint(&uri, config.clone(), &t)?;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt = tokio::time::timeout(left, endpoint.clone().connect()).await;
        match attempt {
            Ok(Ok(ch)) => {
                return Ok(Client {
                    rpc: ParameterServerClient::new(ch.clone())
                        .max_decoding_message_size(MAX_MESSAGE)
                        .max_encoding_message_size(MAX_MESSAGE),
                    ch,
                    uri,
                });
            }
            Err(_) => {
                return Err(WorkerError::Deadline {
                    ps,
                    server: uri,
                    call: "connect".into(),
                    after: t.connect,
                    setting: CONNECT_SETTING,
                });
            }
            Ok(Err(e)) if Instant::now() >= deadline => {
                return Err(WorkerError::Unavailable {
                    ps,
                    source: format!(
                        "{uri}: {e} (retried for {:?}; {CONNECT_SETTING} sets how long)",
                        t.connect
                    )
                    .into(),
                });
            }
            Ok(Err(e)) => {
                tracing::debug!(ps, %uri, %e, "PS not up yet; retrying");
                let pause = Duration::from_millis(100).min(left);
                tokio::time::sleep(pause).await;
            }
        }
    }
}

/// The channel settings of a training connection: the spec's keep-alive, unless the
/// transport settings carry one (`IBEX_KEEPALIVE_MS` through `Config::from_env`, or the
/// caller's), which wins as it does for every Ibex connection; and the call deadline as the
/// cap on any call that sets none.
fn endpoint(uri: &str, config: Config, t: &Timeouts) -> Result<Endpoint, ibex_transport::Error> {
    let (interval, wait) = match config.keepalive {
        Some(i) => (Some(i), config.keepalive_timeout),
        None => (t.keepalive, t.keepalive_timeout),
    };
    // The channel's own connect timeout bounds its later reconnects; it is a little longer
    // than the connect deadline so that on the first connect that deadline fires first and
    // its error is the one the caller sees.
    let mut ep = Endpoint::new(uri)?
        .config(config)
        .connect_timeout(t.connect.saturating_add(Duration::from_secs(1)))
        .timeout(t.call);
    if let Some(i) = interval {
        ep = ep.http2_keep_alive_interval(i).keep_alive_timeout(wait);
    }
    Ok(ep)
}
