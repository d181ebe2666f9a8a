//! `ibex._native`: the Rust side of the `ibex` Python package (see `docs/python.md`).
//!
//! One [`ibex_worker::Worker`] per Python `Worker`, driven by a process-wide tokio runtime.
//! Every call that waits on the network releases the GIL first (`Python::detach`), so other
//! Python threads (a data loader, autograd's hooks) run meanwhile. NumPy arrays cross
//! without an intermediate copy: a push reads the caller's float32 array in place (the
//! worker's one copy goes straight into its registered buffer, as from Rust), pulls hand
//! back the worker's vectors as arrays that own them, and `stage()` gives NumPy views of the
//! registered buffers themselves.

use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use ibex_worker::{ClusterSpec, Dtype, Init, Optimizer, OutBuf, VarSpec, WorkerError};
use numpy::ndarray::{ArrayViewMut, IxDyn};
use numpy::{
    PyArray, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn,
    PyReadwriteArrayDyn, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyWeakrefMethods, PyWeakrefReference};

create_exception!(
    ibex,
    IbexError,
    PyException,
    "Base class of every Ibex error."
);
create_exception!(
    ibex,
    UnknownVariableError,
    IbexError,
    "The variable was not created (create_variables) or a PS does not know it."
);
create_exception!(
    ibex,
    ShapeMismatchError,
    IbexError,
    "An array's shape or element count does not match its variable."
);
create_exception!(
    ibex,
    StaleStepError,
    IbexError,
    "The PS already applied that step, or this worker pushed the variable twice for it."
);
create_exception!(
    ibex,
    PsTimeoutError,
    IbexError,
    "A sync step did not complete within the PS's --sync-timeout-secs."
);
create_exception!(
    ibex,
    UnavailableError,
    IbexError,
    "A PS cannot be reached: not started, dead, or shutting down."
);
create_exception!(
    ibex,
    DeadlineError,
    IbexError,
    "A PS did not answer a call, or could not be reached, within its deadline (connect_timeout, call_timeout)."
);
create_exception!(
    ibex,
    RejectedError,
    IbexError,
    "The PS rejected the request as malformed (INVALID_ARGUMENT, OUT_OF_RANGE, ALREADY_EXISTS)."
);
create_exception!(
    ibex,
    BufferBusyError,
    IbexError,
    "A staging buffer is still held by a push in flight or another lease."
);
create_exception!(
    ibex,
    SpecError,
    IbexError,
    "The cluster spec (TOML, TF_CONFIG, Slurm) is missing or invalid."
);

/// The runtime every worker call runs on. Built on first use, after
/// `keep_freed_memory()`: its threads must start with the allocator settings that let step
/// buffers be reused instead of mapped afresh each step (docs/ps.md, "Process memory").
fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    static RT: OnceLock<Result<(u32, tokio::runtime::Runtime), String>> = OnceLock::new();
    let (pid, rt) = RT
        .get_or_init(|| {
            ibex_transport::conn::keep_freed_memory();
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("ibex-worker")
                .enable_all()
                .build()
                .map(|rt| (std::process::id(), rt))
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| PyRuntimeError::new_err(format!("starting the Ibex runtime: {e}")))?;
    // A forked child has the runtime but not its threads, which drive its timers and
    // sockets: every call would hang.
    if *pid != std::process::id() {
        return Err(IbexError::new_err(
            "this process was forked from one that had already used Ibex, and the runtime's \
             threads do not survive a fork: start worker processes with multiprocessing's \
             'spawn' or 'forkserver' method (multiprocessing.get_context(\"spawn\"))",
        ));
    }
    Ok(rt)
}

/// How long a blocked call runs with the GIL released before it looks for a signal.
const SIGNAL_SLICE: Duration = Duration::from_millis(50);

/// Runs `fut` to completion with the GIL released, in slices of [`SIGNAL_SLICE`]: between
/// them Python's signal handlers run (`check_signals`), so Ctrl-C interrupts a blocked
/// connect or step within about that. An interrupted call's future is dropped here, on
/// the caller's thread, before the call returns, so borrows of NumPy memory it holds end
/// with it; what it had sent stays sent (a push may still count on the PS).
fn block<T: Send>(py: Python<'_>, fut: impl Future<Output = T> + Send) -> PyResult<T> {
    let rt = runtime()?;
    let mut fut = std::pin::pin!(fut);
    loop {
        let slice =
            py.detach(|| rt.block_on(async { tokio::time::timeout(SIGNAL_SLICE, &mut fut).await }));
        match slice {
            Ok(v) => return Ok(v),
            Err(_) => py.check_signals()?,
        }
    }
}

/// A worker error as the Python exception of its kind, with the Rust message.
fn err(e: WorkerError) -> PyErr {
    let msg = e.to_string();
    match e {
        WorkerError::UnknownVariable { .. } => UnknownVariableError::new_err(msg),
        WorkerError::ShapeMismatch { .. } => ShapeMismatchError::new_err(msg),
        WorkerError::StaleStep { .. } => StaleStepError::new_err(msg),
        WorkerError::Timeout { .. } => PsTimeoutError::new_err(msg),
        WorkerError::Deadline { .. } => DeadlineError::new_err(msg),
        WorkerError::Unavailable { .. } => UnavailableError::new_err(msg),
        WorkerError::Rejected { .. } => RejectedError::new_err(msg),
        WorkerError::BufferBusy { .. } => BufferBusyError::new_err(msg),
        // A read failing on a dead PS's connection comes back as an RPC error with code
        // UNAVAILABLE; Python callers want one exception type for "the PS is gone".
        WorkerError::Rpc {
            code: tonic::Code::Unavailable,
            ..
        } => UnavailableError::new_err(msg),
        _ => IbexError::new_err(msg),
    }
}

/// A cluster spec and, where the source says it, this task's role and index.
#[pyclass(frozen, module = "ibex._native")]
struct Spec {
    spec: ClusterSpec,
    job: Option<String>,
    index: Option<usize>,
}

#[pymethods]
impl Spec {
    /// `[cluster] ps = [..] workers = [..] transport = ".."` as text.
    #[staticmethod]
    fn from_toml(text: &str) -> PyResult<Spec> {
        let spec = ClusterSpec::from_toml_str(text).map_err(spec_err)?;
        Ok(Spec {
            spec,
            job: None,
            index: None,
        })
    }

    /// A TOML spec file.
    #[staticmethod]
    fn from_file(path: std::path::PathBuf) -> PyResult<Spec> {
        let spec = ClusterSpec::from_toml_file(&path).map_err(spec_err)?;
        Ok(Spec {
            spec,
            job: None,
            index: None,
        })
    }

    /// TensorFlow's TF_CONFIG JSON (the task's type and index come with it).
    #[staticmethod]
    fn from_tf_config(json: &str) -> PyResult<Spec> {
        let (spec, job, index) = ClusterSpec::from_tf_config(json).map_err(spec_err)?;
        Ok(Spec {
            spec,
            job: Some(job.to_string()),
            index: Some(index),
        })
    }

    /// The Slurm step this process runs in (SLURM_PROCID, SLURM_NTASKS, the node list).
    #[staticmethod]
    fn from_slurm() -> PyResult<Spec> {
        let (spec, job, index) = ClusterSpec::from_slurm_env().map_err(spec_err)?;
        Ok(Spec {
            spec,
            job: Some(job.to_string()),
            index: Some(index),
        })
    }

    /// The PS addresses (`host:port`), in shard order.
    #[getter]
    fn ps(&self) -> Vec<String> {
        self.spec.ps.clone()
    }

    /// The worker addresses, in index order.
    #[getter]
    fn workers(&self) -> Vec<String> {
        self.spec.workers.clone()
    }

    /// `"shm"`, `"tcp"`, `"verbs"` or `"grpc"`.
    #[getter]
    fn transport(&self) -> &'static str {
        self.spec.transport.as_str()
    }

    /// `"ps"` or `"worker"` where the source names this task's role.
    #[getter]
    fn job(&self) -> Option<String> {
        self.job.clone()
    }

    /// This task's index within its job, where the source names it.
    #[getter]
    fn index(&self) -> Option<usize> {
        self.index
    }

    /// The same spec naming this task's role (`"ps"` or `"worker"`) and index, as
    /// TF_CONFIG and Slurm specs do; the index must be in range.
    fn with_task(&self, job: &str, index: usize) -> PyResult<Spec> {
        let n = match job {
            "worker" => self.spec.workers.len(),
            "ps" => self.spec.ps.len(),
            j => {
                return Err(PyValueError::new_err(format!(
                    "job must be \"worker\" or \"ps\", not {j:?}"
                )));
            }
        };
        if index >= n {
            return Err(SpecError::new_err(format!(
                "{job} index {index} is out of range: the spec lists {n} {job} tasks"
            )));
        }
        Ok(Spec {
            spec: self.spec.clone(),
            job: Some(job.to_string()),
            index: Some(index),
        })
    }

    /// The URI PS `i` listens on (what `python -m ibex.ps --listen` takes).
    fn ps_listen_uri(&self, i: usize) -> PyResult<String> {
        if i >= self.spec.ps.len() {
            return Err(PyValueError::new_err(format!(
                "PS index {i} is out of range: the spec lists {} PS",
                self.spec.ps.len()
            )));
        }
        Ok(self.spec.ps_listen_uri(i))
    }

    /// The spec as cluster TOML text (what `from_toml` reads).
    fn to_toml(&self) -> String {
        self.spec.to_toml()
    }

    /// The same spec with other bounds, in seconds (docs/ps.md, "Failures"): `sync` is
    /// the PS's sync timeout, which `connect` and `call` follow unless given; `keepalive`
    /// 0 turns pings off. Each must be positive.
    #[pyo3(signature = (*, sync=None, connect=None, call=None, keepalive=None))]
    fn with_timeouts(
        &self,
        sync: Option<f64>,
        connect: Option<f64>,
        call: Option<f64>,
        keepalive: Option<f64>,
    ) -> PyResult<Spec> {
        let secs = |name: &str, v: f64| {
            std::time::Duration::try_from_secs_f64(v).map_err(|_| {
                PyValueError::new_err(format!(
                    "{name}={v} is not a number of seconds (examples: 10, 0.5)"
                ))
            })
        };
        let mut t = self.spec.timeouts;
        if let Some(v) = sync {
            let keep = (t.keepalive, t.keepalive_timeout);
            t = ibex_worker::Timeouts::following(secs("sync_timeout", v)?);
            (t.keepalive, t.keepalive_timeout) = keep;
        }
        if let Some(v) = connect {
            t.connect = secs("connect_timeout", v)?;
        }
        if let Some(v) = call {
            t.call = secs("call_timeout", v)?;
        }
        if let Some(v) = keepalive {
            t.keepalive = Some(secs("keepalive", v)?).filter(|k| !k.is_zero());
        }
        Ok(Spec {
            spec: self.spec.clone().with_timeouts(t).map_err(spec_err)?,
            job: self.job.clone(),
            index: self.index,
        })
    }

    /// The bounds in seconds: `{"sync", "connect", "call", "keepalive"}` (keepalive None
    /// when off).
    #[getter]
    fn timeouts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let t = self.spec.timeouts;
        let d = PyDict::new(py);
        d.set_item("sync", t.sync.as_secs_f64())?;
        d.set_item("connect", t.connect.as_secs_f64())?;
        d.set_item("call", t.call.as_secs_f64())?;
        d.set_item("keepalive", t.keepalive.map(|k| k.as_secs_f64()))?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "Spec(ps={:?}, workers={:?}, transport={:?})",
            self.spec.ps,
            self.spec.workers,
            self.spec.transport.as_str()
        )
    }
}

fn spec_err(e: ibex_worker::SpecError) -> PyErr {
    SpecError::new_err(e.to_string())
}

/// A float32 array as a flat slice of `name`'s variable: the exact dtype, C order, and either
/// the variable's shape or a flat array of its element count. Errors say what to pass.
fn grad<'py>(
    w: &ibex_worker::Worker,
    name: &str,
    obj: &Bound<'py, PyAny>,
) -> PyResult<PyReadonlyArrayDyn<'py, f32>> {
    let arr = array_f32(name, obj)?;
    let shape = w
        .placement(name)
        .ok_or_else(|| err(WorkerError::UnknownVariable { name: name.into() }))?
        .spec
        .shape;
    check_shape(name, arr.shape(), &shape)?;
    arr.try_readonly()
        .map_err(|e| PyValueError::new_err(format!("array for {name:?} cannot be read: {e}")))
}

/// `obj` as a C-contiguous, native-endian float32 array, or a TypeError/ValueError naming
/// the variable and the fix.
fn array_f32<'py>(name: &str, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
    let untyped = obj.cast::<PyUntypedArray>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{name:?}: expected a numpy.ndarray of float32, got {}",
            obj.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "an unknown type".into())
        ))
    })?;
    let py = obj.py();
    if !untyped.dtype().is_equiv_to(&numpy::dtype::<f32>(py)) {
        return Err(PyTypeError::new_err(format!(
            "{name:?}: expected a float32 array, got dtype {}; convert it with a.astype(numpy.float32)",
            untyped
                .dtype()
                .str()
                .map(|s| s.to_string())
                .unwrap_or_else(|_| "?".into())
        )));
    }
    if !untyped.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "{name:?}: the array is not C-contiguous (a slice or a transpose?); Ibex reads it in \
             place, so pass numpy.ascontiguousarray(a)"
        )));
    }
    obj.cast::<PyArrayDyn<f32>>()
        .cloned()
        .map_err(|e| PyTypeError::new_err(format!("{name:?}: {e}")))
}

/// The array must have the variable's shape, or be flat with its element count.
fn check_shape(name: &str, got: &[usize], want: &[usize]) -> PyResult<()> {
    let numel: usize = want.iter().product();
    let flat_ok = got.len() == 1 && got[0] == numel;
    if got == want || flat_ok {
        return Ok(());
    }
    Err(ShapeMismatchError::new_err(format!(
        "shape mismatch for {name:?}: the variable has shape {want:?} ({numel} elements), the array has shape {got:?}"
    )))
}

/// The values of `name` as a new array of the variable's shape that owns `v` (no copy).
fn owned_array<'py>(py: Python<'py>, v: Vec<f32>, shape: &[usize]) -> PyResult<Bound<'py, PyAny>> {
    let a = PyArray::from_vec(py, v);
    Ok(a.reshape(shape.to_vec())?.into_any())
}

/// The caller's arrays (`out[i]` for `names[i]`) as memory a pull writes into in place:
/// each checked (float32, C order, the variable's shape, writable) and borrowed for writing
/// while the returned guards live. Each buffer holds a reference to its array, so the
/// memory outlives a read still in flight after an interrupted call.
#[allow(clippy::type_complexity)]
fn out_bufs<'py>(
    w: &ibex_worker::Worker,
    names: &[String],
    out: &Bound<'py, PyList>,
) -> PyResult<(Vec<PyReadwriteArrayDyn<'py, f32>>, Vec<OutBuf>)> {
    check_out_len(names.len(), out)?;
    let mut guards = Vec::with_capacity(names.len());
    let mut bufs = Vec::with_capacity(names.len());
    for (name, o) in names.iter().zip(out.iter()) {
        let arr = array_f32(name, &o)?;
        let shape = w
            .placement(name)
            .ok_or_else(|| err(WorkerError::UnknownVariable { name: name.clone() }))?
            .spec
            .shape;
        check_shape(name, arr.shape(), &shape)?;
        let mut rw = arr.try_readwrite().map_err(|e| {
            PyValueError::new_err(format!(
                "output array for {name:?} cannot be written ({e}); pass a writable array that \
                 no other output shares"
            ))
        })?;
        let dst = rw
            .as_slice_mut()
            .map_err(|e| PyValueError::new_err(format!("output array for {name:?}: {e}")))?;
        let owner: Arc<dyn std::any::Any + Send + Sync> = Arc::new(o.clone().unbind());
        // SAFETY: `dst` is the array's own C-contiguous float32 memory, `len` values long;
        // NumPy keeps it in place while the array lives, and `owner` holds the array. The
        // write borrow (`rw`, kept by the caller for the call) keeps other Ibex calls from
        // writing it meanwhile.
        bufs.push(unsafe { OutBuf::from_raw(dst.as_mut_ptr(), dst.len(), owner) });
        guards.push(rw);
    }
    Ok((guards, bufs))
}

fn check_out_len(names: usize, out: &Bound<'_, PyList>) -> PyResult<()> {
    if out.len() != names {
        return Err(PyValueError::new_err(format!(
            "{names} variables but {} output arrays: pass one per variable, in the same order",
            out.len()
        )));
    }
    Ok(())
}

/// A parameter-server worker (`ibex.Worker` wraps it).
#[pyclass(frozen, module = "ibex._native")]
struct Worker {
    inner: Arc<ibex_worker::Worker>,
}

/// One variable definition as `ibex.Variable._native()` lays it out.
type VarTuple = (
    String,
    Vec<usize>,
    String,
    (String, f32, u64),
    (String, f32, f32, f32, f32),
    bool,
);

fn var_spec(t: VarTuple) -> PyResult<VarSpec> {
    let (name, shape, dtype, (init, value, seed), (opt, lr, a, b, c), sparse) = t;
    let dtype = match dtype.as_str() {
        "float32" | "f32" => Dtype::F32,
        "float16" | "f16" => Dtype::F16,
        "bfloat16" | "bf16" => Dtype::Bf16,
        d => {
            return Err(PyValueError::new_err(format!(
                "{name:?}: unknown storage dtype {d:?}: use float32, float16 or bfloat16"
            )));
        }
    };
    let init = match init.as_str() {
        "zeros" => Init::Zeros,
        "constant" => Init::Constant(value),
        "normal" => Init::Normal { std: value, seed },
        "glorot_uniform" => Init::GlorotUniform { seed },
        i => {
            return Err(PyValueError::new_err(format!(
                "{name:?}: unknown initializer {i:?}: use zeros, constant, normal or glorot_uniform"
            )));
        }
    };
    let optimizer = match opt.as_str() {
        "sgd" => Optimizer::Sgd { lr },
        "momentum" => Optimizer::Momentum { lr, momentum: a },
        "adagrad" => Optimizer::Adagrad { lr, eps: a },
        "adam" => Optimizer::Adam {
            lr,
            beta1: a,
            beta2: b,
            eps: c,
        },
        o => {
            return Err(PyValueError::new_err(format!(
                "{name:?}: unknown optimizer {o:?}: use sgd, momentum, adagrad or adam"
            )));
        }
    };
    Ok(VarSpec {
        name,
        dtype,
        shape,
        init,
        optimizer,
        sparse,
    })
}

#[pymethods]
impl Worker {
    /// Connects to every PS of `spec` (retrying each while it starts, for up to the spec's
    /// connect timeout).
    #[staticmethod]
    fn connect(py: Python<'_>, spec: &Spec, index: usize) -> PyResult<Worker> {
        if index >= spec.spec.workers.len() {
            return Err(SpecError::new_err(format!(
                "worker index {index} is out of range: the spec lists {} workers",
                spec.spec.workers.len()
            )));
        }
        let config = ibex_worker::transport_config().map_err(spec_err)?;
        let w =
            block(py, ibex_worker::Worker::connect(&spec.spec, index, &config))?.map_err(err)?;
        Ok(Worker { inner: Arc::new(w) })
    }

    /// Number of PS shards.
    #[getter]
    fn num_ps(&self) -> usize {
        self.inner.num_ps()
    }

    /// Creates (idempotently) the variables on their PS; see `ibex.Variable`.
    fn create_variables(&self, py: Python<'_>, vars: Vec<VarTuple>) -> PyResult<()> {
        let specs = vars
            .into_iter()
            .map(var_spec)
            .collect::<PyResult<Vec<_>>>()?;
        block(py, self.inner.create_variables(&specs))?.map_err(err)
    }

    /// `[(ps, part_name, row_offset, rows)]` of a created variable, or None.
    fn placement(&self, name: &str) -> Option<Vec<(usize, String, usize, usize)>> {
        self.inner.placement(name).map(|p| {
            p.parts
                .iter()
                .map(|part| (part.ps, part.name.clone(), part.row_offset, part.rows))
                .collect()
        })
    }

    /// The full shape of a created variable, or None.
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.inner.placement(name).map(|p| p.spec.shape)
    }

    /// Pushes `grads` (`[(name, float32 array)]`) for `step`; each array is read in place.
    fn push(
        &self,
        py: Python<'_>,
        step: u64,
        grads: Vec<(String, Bound<'_, PyAny>)>,
    ) -> PyResult<()> {
        let arrays = self.grads(&grads)?;
        let pairs = pairs(&grads, &arrays)?;
        block(py, self.inner.push(step, &pairs))?.map_err(err)
    }

    /// Pushes `grads` for `step` and returns (or writes into `out`) the values after it.
    #[pyo3(signature = (step, grads, out=None))]
    fn push_pull<'py>(
        &self,
        py: Python<'py>,
        step: u64,
        grads: Vec<(String, Bound<'py, PyAny>)>,
        out: Option<Bound<'py, PyList>>,
    ) -> PyResult<Option<Vec<Bound<'py, PyAny>>>> {
        let arrays = self.grads(&grads)?;
        let pairs = pairs(&grads, &arrays)?;
        let names: Vec<String> = grads.iter().map(|(n, _)| n.clone()).collect();
        if let Some(o) = &out {
            let (_guards, bufs) = out_bufs(&self.inner, &names, o)?;
            block(py, self.inner.push_pull_into_bufs(step, &pairs, &bufs))?.map_err(err)?;
            return Ok(None);
        }
        let vals = block(py, self.inner.push_pull(step, &pairs))?.map_err(err)?;
        drop(arrays);
        self.deliver(py, &names, vals)
    }

    /// Values of `names` after `step` steps (sync mode waits for them).
    #[pyo3(signature = (names, step, out=None))]
    fn pull<'py>(
        &self,
        py: Python<'py>,
        names: Vec<String>,
        step: u64,
        out: Option<Bound<'py, PyList>>,
    ) -> PyResult<Option<Vec<Bound<'py, PyAny>>>> {
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        if let Some(o) = &out {
            let (_guards, bufs) = out_bufs(&self.inner, &names, o)?;
            block(py, self.inner.pull_into_bufs(&refs, step, &bufs))?.map_err(err)?;
            return Ok(None);
        }
        let vals = block(py, self.inner.pull(&refs, step))?.map_err(err)?;
        self.deliver(py, &names, vals)
    }

    /// A write lease on the registered gradient buffers of `names`. Waits while a push of
    /// one of them is in flight or another lease holds one, for at most `timeout` seconds:
    /// a lease still alive in this thread would otherwise block it for ever.
    #[pyo3(signature = (names, timeout=30.0))]
    fn stage(slf: &Bound<'_, Self>, names: Vec<String>, timeout: f64) -> PyResult<Staged> {
        let py = slf.py();
        let limit = std::time::Duration::try_from_secs_f64(timeout).map_err(|_| {
            PyValueError::new_err(format!(
                "timeout must be a non-negative number of seconds, got {timeout}"
            ))
        })?;
        let w = slf.get().inner.clone();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let staged = // The timer is made inside the future: tokio's timers need the runtime's context.
        block(py, async { tokio::time::timeout(limit, w.stage(&refs)).await })?
            .map_err(|_| {
                BufferBusyError::new_err(format!(
                    "the staging buffers of {names:?} were still held after {timeout}s: by a push \
                     that has not returned, or by a lease that was neither pushed nor released \
                     (call release() on it)"
                ))
            })?
            .map_err(err)?;
        Ok(Staged::new(slf, staged))
    }

    /// As `stage`, but a BufferBusyError instead of waiting.
    fn try_stage(slf: &Bound<'_, Self>, names: Vec<String>) -> PyResult<Staged> {
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let staged = slf.get().inner.try_stage(&refs).map_err(err)?;
        Ok(Staged::new(slf, staged))
    }

    /// Pushes the staged buffers for `step`; the lease's views become read-only.
    fn push_staged(&self, py: Python<'_>, step: u64, staged: &Staged) -> PyResult<()> {
        let lease = staged.take(py)?;
        block(py, self.inner.push_staged(step, lease))?.map_err(err)
    }

    /// As `push_staged`, then returns (or writes into `out`) the fresh values of the staged
    /// variables, in the order they were staged.
    #[pyo3(signature = (step, staged, out=None))]
    fn push_pull_staged<'py>(
        &self,
        py: Python<'py>,
        step: u64,
        staged: &Staged,
        out: Option<Bound<'py, PyList>>,
    ) -> PyResult<Option<Vec<Bound<'py, PyAny>>>> {
        let names = staged.names()?;
        if let Some(o) = &out {
            let (_guards, bufs) = out_bufs(&self.inner, &names, o)?;
            let lease = staged.take(py)?;
            block(
                py,
                self.inner.push_pull_staged_into_bufs(step, lease, &bufs),
            )?
            .map_err(err)?;
            return Ok(None);
        }
        let lease = staged.take(py)?;
        let vals = block(py, self.inner.push_pull_staged(step, lease))?.map_err(err)?;
        self.deliver(py, &names, vals)
    }

    /// Starts step `step` for pushing layer by layer (`StepPush`).
    fn begin_step(&self, step: u64) -> StepPush {
        StepPush {
            worker: self.inner.clone(),
            inner: Mutex::new(Some(self.inner.begin_step(step))),
            step,
        }
    }

    /// Rows `ids` of sparse table `table`, as a `(len(ids), dim)` array.
    fn lookup_rows<'py>(
        &self,
        py: Python<'py>,
        table: &str,
        ids: Vec<u64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let shape = self
            .inner
            .placement(table)
            .ok_or_else(|| err(WorkerError::UnknownVariable { name: table.into() }))?
            .spec
            .shape;
        let dim: usize = shape.iter().skip(1).product();
        let n = ids.len();
        let rows = block(py, self.inner.lookup_rows(table, &ids))?.map_err(err)?;
        owned_array(py, rows, &[n, dim])
    }

    /// Row gradients (`(len(ids), dim)` float32) of sparse table `table` for `step`.
    fn push_sparse(
        &self,
        py: Python<'_>,
        step: u64,
        table: &str,
        ids: Vec<u64>,
        grads: Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let arr = array_f32(table, &grads)?;
        let ro = arr
            .try_readonly()
            .map_err(|e| PyValueError::new_err(format!("array for {table:?}: {e}")))?;
        let g = ro
            .as_slice()
            .map_err(|e| PyValueError::new_err(format!("array for {table:?}: {e}")))?;
        block(py, self.inner.push_sparse(step, table, &ids, g))?.map_err(err)
    }

    /// Asks every PS to write a checkpoint now; returns their steps.
    fn save(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        block(py, self.inner.save())?.map_err(err)
    }

    /// Restores every PS to the newest checkpoint step they all hold; returns that step.
    fn restore(&self, py: Python<'_>) -> PyResult<u64> {
        block(py, self.inner.recover())?.map_err(err)
    }

    /// Steps applied so far, as all PS agree.
    fn current_step(&self, py: Python<'_>) -> PyResult<u64> {
        block(py, self.inner.current_step())?.map_err(err)
    }

    /// Every PS's Stats, as dicts in PS order.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let stats = block(py, self.inner.stats())?.map_err(err)?;
        stats
            .into_iter()
            .map(|s| {
                let d = PyDict::new(py);
                d.set_item("shard", s.shard)?;
                d.set_item("step", s.step)?;
                d.set_item("mode", s.mode)?;
                d.set_item("num_workers", s.num_workers)?;
                d.set_item("checkpoint_steps", s.checkpoint_steps)?;
                let vars: Vec<(String, Vec<u64>)> =
                    s.vars.into_iter().map(|v| (v.name, v.shape)).collect();
                d.set_item("variables", vars)?;
                d.set_item("bytes_pushed", s.bytes_pushed)?;
                d.set_item("bytes_pulled", s.bytes_pulled)?;
                let rpcs: Vec<(String, u64)> =
                    s.rpcs.into_iter().map(|r| (r.method, r.count)).collect();
                d.set_item("rpcs", rpcs)?;
                Ok(d)
            })
            .collect()
    }

    /// The communication profile as `ibex demo` prints it.
    fn comm_profile(&self) -> String {
        self.inner.comm_profile().to_string()
    }

    /// Each Ibex connection's transport counters: `[(ps, {counter: value})]`.
    fn connection_stats<'py>(&self, py: Python<'py>) -> PyResult<Vec<(usize, Bound<'py, PyDict>)>> {
        self.inner
            .comm_profile()
            .transport
            .into_iter()
            .map(|(ps, s)| {
                let d = PyDict::new(py);
                d.set_item("provider", s.provider)?;
                d.set_item("rendezvous_path", s.rendezvous_path)?;
                d.set_item("rndv_read_bytes", s.rndv_read_bytes)?;
                d.set_item("rndv_mapped_bytes", s.rndv_mapped_bytes)?;
                d.set_item("pool_bytes_sent", s.pool_bytes_sent)?;
                d.set_item("remote_read_bytes", s.remote_read_bytes)?;
                d.set_item("exposed_from_pool", s.exposed_from_pool)?;
                d.set_item("reg_cache_hits", s.reg_cache_hits)?;
                d.set_item("reg_cache_misses", s.reg_cache_misses)?;
                Ok((ps, d))
            })
            .collect()
    }

    /// Where each part's staging buffer lives: `[(ps, bytes, fallback or None)]`.
    fn staging_info(&self, name: &str) -> Option<Vec<(usize, usize, Option<String>)>> {
        self.inner
            .staging_info(name)
            .map(|v| v.into_iter().map(|i| (i.ps, i.bytes, i.fallback)).collect())
    }
}

impl Worker {
    /// Checks and borrows every gradient array before anything is sent.
    fn grads<'py>(
        &self,
        grads: &[(String, Bound<'py, PyAny>)],
    ) -> PyResult<Vec<PyReadonlyArrayDyn<'py, f32>>> {
        grads
            .iter()
            .map(|(name, a)| grad(&self.inner, name, a))
            .collect()
    }

    /// The values as new arrays that own the pulled vectors.
    fn deliver<'py>(
        &self,
        py: Python<'py>,
        names: &[String],
        vals: Vec<Vec<f32>>,
    ) -> PyResult<Option<Vec<Bound<'py, PyAny>>>> {
        names
            .iter()
            .zip(vals)
            .map(|(n, v)| {
                let shape = self.inner.placement(n).map(|p| p.spec.shape);
                owned_array(py, v, shape.as_deref().unwrap_or(&[]))
            })
            .collect::<PyResult<Vec<_>>>()
            .map(Some)
    }
}

/// `(name, slice)` pairs borrowing the checked arrays' memory in place.
fn pairs<'a>(
    grads: &'a [(String, Bound<'_, PyAny>)],
    arrays: &'a [PyReadonlyArrayDyn<'_, f32>],
) -> PyResult<Vec<(&'a str, &'a [f32])>> {
    grads
        .iter()
        .zip(arrays)
        .map(|((n, _), a)| {
            let s = a
                .as_slice()
                .map_err(|e| PyValueError::new_err(format!("array for {n:?}: {e}")))?;
            Ok((n.as_str(), s))
        })
        .collect()
}

struct StagedState {
    /// The lease until it is pushed (or dropped with this object).
    lease: Option<ibex_worker::Staged>,
    /// Every view handed out, made read-only when the lease is pushed. Weak: each view
    /// holds this lease as its base, and strong references back would make a cycle the
    /// garbage collector cannot see, keeping an abandoned lease (and its buffers) for ever.
    views: Vec<Py<PyWeakrefReference>>,
}

/// A write lease on registered gradient buffers, with NumPy views of them (`Worker.stage`).
#[pyclass(frozen, module = "ibex._native")]
struct Staged {
    /// Keeps the worker, whose staging cache owns the buffers the views point into, alive
    /// as long as any view (each view's base is this object).
    worker: Py<Worker>,
    state: Mutex<StagedState>,
}

#[pymethods]
impl Staged {
    /// Names of the staged variables, in staging order.
    fn names(&self) -> PyResult<Vec<String>> {
        let st = self.lock()?;
        let lease = lease_of(&st)?;
        Ok(lease.names().map(str::to_string).collect())
    }

    /// The whole registered buffer of `name` as a writable float32 array of the
    /// variable's shape; the variable must have one part (see `parts`).
    fn array<'py>(slf: &Bound<'py, Self>, name: &str) -> PyResult<Bound<'py, PyAny>> {
        let this = slf.get();
        let shape = this
            .worker
            .get()
            .inner
            .placement(name)
            .ok_or_else(|| err(WorkerError::UnknownVariable { name: name.into() }))?
            .spec
            .shape;
        let (ptr, len) = {
            let mut st = this.lock()?;
            let lease = lease_mut(&mut st)?;
            let s = lease.var_mut(name).map_err(err)?;
            (s.as_mut_ptr(), s.len())
        };
        this.view(slf, ptr, len, shape)
    }

    /// Every part of `name` as `(row_offset, writable float32 array of its rows)`, in dim-0
    /// order; concatenated they are the whole variable.
    fn parts<'py>(slf: &Bound<'py, Self>, name: &str) -> PyResult<Vec<(usize, Bound<'py, PyAny>)>> {
        let this = slf.get();
        let shape = this
            .worker
            .get()
            .inner
            .placement(name)
            .ok_or_else(|| err(WorkerError::UnknownVariable { name: name.into() }))?
            .spec
            .shape;
        let parts: Vec<(usize, usize, *mut f32, usize)> = {
            let mut st = this.lock()?;
            let lease = lease_mut(&mut st)?;
            lease
                .parts_mut(name)
                .map_err(err)?
                .into_iter()
                .map(|p| (p.row_offset, p.rows, p.values.as_mut_ptr(), p.values.len()))
                .collect()
        };
        parts
            .into_iter()
            .map(|(row_offset, rows, ptr, len)| {
                let mut s = shape.clone();
                if let Some(d0) = s.first_mut() {
                    *d0 = rows;
                }
                Ok((row_offset, this.view(slf, ptr, len, s)?))
            })
            .collect()
    }

    /// Copies a whole gradient (float32, the variable's shape) into the parts of `name`.
    fn write(&self, name: &str, values: Bound<'_, PyAny>) -> PyResult<()> {
        let shape = self
            .worker
            .get()
            .inner
            .placement(name)
            .ok_or_else(|| err(WorkerError::UnknownVariable { name: name.into() }))?
            .spec
            .shape;
        let arr = array_f32(name, &values)?;
        check_shape(name, arr.shape(), &shape)?;
        let ro = arr
            .try_readonly()
            .map_err(|e| PyValueError::new_err(format!("array for {name:?}: {e}")))?;
        let src = ro
            .as_slice()
            .map_err(|e| PyValueError::new_err(format!("array for {name:?}: {e}")))?;
        let mut st = self.lock()?;
        lease_mut(&mut st)?.write(name, src).map_err(err)
    }

    /// Releases the buffers without pushing; views become read-only.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        drop(self.take(py)?);
        Ok(())
    }

    /// True once pushed or released.
    #[getter]
    fn consumed(&self) -> PyResult<bool> {
        Ok(self.lock()?.lease.is_none())
    }
}

impl Staged {
    fn new(worker: &Bound<'_, Worker>, lease: ibex_worker::Staged) -> Staged {
        Staged {
            worker: worker.clone().unbind(),
            state: Mutex::new(StagedState {
                lease: Some(lease),
                views: Vec::new(),
            }),
        }
    }

    fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, StagedState>> {
        self.state
            .lock()
            .map_err(|_| IbexError::new_err("a staging lease was poisoned by a panic"))
    }

    /// A NumPy view of `len` f32 at `ptr` with `shape`, based on this object.
    fn view<'py>(
        &self,
        slf: &Bound<'py, Self>,
        ptr: *mut f32,
        len: usize,
        shape: Vec<usize>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if shape.iter().product::<usize>() != len {
            return Err(IbexError::new_err(format!(
                "staging buffer of {len} values does not match shape {shape:?}"
            )));
        }
        // SAFETY: `ptr..ptr + len` is a part's registered buffer, which the worker's staging
        // cache owns and never frees or moves while the worker lives; the array's base is
        // this Staged object, which holds the worker, so the memory outlives the array. The
        // lease grants exclusive write access until it is pushed; `take` then makes every
        // view read-only before the transport may read the buffer.
        let arr = unsafe {
            let v = ArrayViewMut::from_shape_ptr(IxDyn(&shape), ptr);
            PyArray::borrow_from_array(&v, slf.clone().into_any())
        };
        let any = arr.into_any();
        let weak = PyWeakrefReference::new(&any)?;
        self.lock()?.views.push(weak.unbind());
        Ok(any)
    }

    /// Takes the lease out (to push or drop it) and makes every view read-only, so Python
    /// can no longer write a buffer the PS may be reading.
    fn take(&self, py: Python<'_>) -> PyResult<ibex_worker::Staged> {
        let (lease, views) = {
            let mut st = self.lock()?;
            let lease = st.lease.take().ok_or_else(consumed_err)?;
            (lease, std::mem::take(&mut st.views))
        };
        let kw = PyDict::new(py);
        kw.set_item("write", false)?;
        for v in views {
            if let Some(view) = v.bind(py).upgrade() {
                view.call_method("setflags", (), Some(&kw))?;
            }
        }
        Ok(lease)
    }
}

fn consumed_err() -> PyErr {
    IbexError::new_err(
        "this staging lease was already pushed or released: call Worker.stage again for the next step",
    )
}

fn lease_of(st: &StagedState) -> PyResult<&ibex_worker::Staged> {
    st.lease.as_ref().ok_or_else(consumed_err)
}

fn lease_mut(st: &mut StagedState) -> PyResult<&mut ibex_worker::Staged> {
    st.lease.as_mut().ok_or_else(consumed_err)
}

/// Pushes of one step, layer by layer, each sent in the background (`Worker.begin_step`).
#[pyclass(frozen, module = "ibex._native")]
struct StepPush {
    worker: Arc<ibex_worker::Worker>,
    inner: Mutex<Option<ibex_worker::StepPush>>,
    step: u64,
}

#[pymethods]
impl StepPush {
    /// The step these pushes contribute to.
    #[getter]
    fn step(&self) -> u64 {
        self.step
    }

    /// Sends `grads` (`[(name, float32 array)]`) in the background and returns once each
    /// array is copied into its variable's registered buffer (the one copy; the caller may
    /// reuse the arrays at once). Waits, like `stage`, while an earlier push of one of the
    /// variables is still in flight.
    fn push(&self, py: Python<'_>, grads: Vec<(String, Bound<'_, PyAny>)>) -> PyResult<()> {
        if self.lock()?.is_none() {
            return Err(step_done());
        }
        let arrays = grads
            .iter()
            .map(|(name, a)| grad(&self.worker, name, a))
            .collect::<PyResult<Vec<_>>>()?;
        let pairs = pairs(&grads, &arrays)?;
        let staged = block(py, self.worker.stage_copied(&pairs))?.map_err(err)?;
        // The background task is spawned on the shared runtime.
        let _enter = runtime()?.enter();
        let mut g = self.lock()?;
        g.as_mut().ok_or_else(step_done)?.push_staged(staged);
        Ok(())
    }

    /// Pushes a staging lease (`Worker.stage`) in the background and returns at once: the
    /// gradients were written into the registered buffers, so nothing is copied. The
    /// lease's views become read-only.
    fn push_staged(&self, py: Python<'_>, staged: &Staged) -> PyResult<()> {
        let mut g = self.lock()?;
        let sp = g.as_mut().ok_or_else(step_done)?;
        let lease = staged.take(py)?;
        let _enter = runtime()?.enter();
        sp.push_staged(lease);
        Ok(())
    }

    /// Waits until every push of the step was accepted.
    fn finish(&self, py: Python<'_>) -> PyResult<()> {
        let sp = self.lock()?.take().ok_or_else(step_done)?;
        block(py, sp.finish())?.map_err(err)
    }

    /// Waits for the pushes and returns (or writes into `out`) the values of `names` after
    /// this step.
    #[pyo3(signature = (names, out=None))]
    fn finish_pull<'py>(
        &self,
        py: Python<'py>,
        names: Vec<String>,
        out: Option<Bound<'py, PyList>>,
    ) -> PyResult<Option<Vec<Bound<'py, PyAny>>>> {
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        if let Some(o) = &out {
            let (_guards, bufs) = out_bufs(&self.worker, &names, o)?;
            let sp = self.lock()?.take().ok_or_else(step_done)?;
            block(py, sp.finish_pull_into_bufs(&refs, &bufs))?.map_err(err)?;
            return Ok(None);
        }
        let sp = self.lock()?.take().ok_or_else(step_done)?;
        let vals = block(py, sp.finish_pull(&refs))?.map_err(err)?;
        let w = Worker {
            inner: self.worker.clone(),
        };
        w.deliver(py, &names, vals)
    }
}

impl StepPush {
    fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, Option<ibex_worker::StepPush>>> {
        self.inner
            .lock()
            .map_err(|_| IbexError::new_err("a step push was poisoned by a panic"))
    }
}

fn step_done() -> PyErr {
    IbexError::new_err("this step was already finished: call Worker.begin_step for the next one")
}

/// Runs one PS shard in this process until SIGTERM/SIGINT (`python -m ibex.ps`); `argv` as
/// `ibex-ps` takes it. Returns the exit status the `ibex-ps` binary would have.
#[pyfunction]
fn run_ps(py: Python<'_>, argv: Vec<String>) -> PyResult<i32> {
    let config = match ibex_ps::PsConfig::from_args(argv) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ibex-ps: {e}");
            return Ok(2);
        }
    };
    let rt = runtime()?;
    let code = py.detach(|| {
        rt.block_on(async move {
            use tokio::signal::unix::{SignalKind, signal};
            let (mut term, mut int) = match (
                signal(SignalKind::terminate()),
                signal(SignalKind::interrupt()),
            ) {
                (Ok(t), Ok(i)) => (t, i),
                (Err(e), _) | (_, Err(e)) => {
                    eprintln!("ibex-ps: installing the signal handlers: {e}");
                    return 1;
                }
            };
            let shutdown = async move {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            };
            match ibex_ps::run(config, shutdown).await {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("ibex-ps: {e}");
                    1
                }
            }
        })
    });
    Ok(code)
}

/// The Rust side of the push benchmark (`python/bench/push_16m.py`): `iters` pushes of
/// `name` from a Rust-owned vector through the same worker, timed in Rust; returns each
/// push's seconds. With no Python between pushes, this is what the same loop costs in a
/// Rust program.
#[pyfunction]
fn bench_rust_push(
    py: Python<'_>,
    worker: &Worker,
    name: String,
    first_step: u64,
    iters: u64,
) -> PyResult<Vec<f64>> {
    let numel = worker
        .inner
        .placement(&name)
        .ok_or_else(|| err(WorkerError::UnknownVariable { name: name.clone() }))?
        .spec
        .numel();
    let grad: Vec<f32> = (0..numel).map(|i| (i % 1000) as f32 * 1e-6).collect();
    let w = worker.inner.clone();
    block(py, async move {
        let mut times = Vec::with_capacity(iters as usize);
        for k in 0..iters {
            let t = Instant::now();
            w.push(first_step + k, &[(name.as_str(), grad.as_slice())])
                .await?;
            times.push(t.elapsed().as_secs_f64());
        }
        Ok::<_, WorkerError>(times)
    })?
    .map_err(err)
}

/// The same push-pull through the Rust worker with Rust-owned vectors: `grads` as
/// little-endian float32 bytes, values back as bytes. The tests compare it bit for bit
/// with what crosses from NumPy.
#[pyfunction]
fn rust_push_pull(
    py: Python<'_>,
    worker: &Worker,
    step: u64,
    grads: Vec<(String, Vec<u8>)>,
) -> PyResult<Vec<Vec<u8>>> {
    let owned: Vec<(String, Vec<f32>)> = grads
        .into_iter()
        .map(|(n, b)| {
            if b.len() % 4 != 0 {
                return Err(PyValueError::new_err(format!(
                    "{n:?}: {} bytes is not a whole number of float32",
                    b.len()
                )));
            }
            let v = b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            Ok((n, v))
        })
        .collect::<PyResult<_>>()?;
    let w = worker.inner.clone();
    let vals = block(py, async move {
        let pairs: Vec<(&str, &[f32])> = owned
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_slice()))
            .collect();
        w.push_pull(step, &pairs).await
    })?
    .map_err(err)?;
    Ok(vals
        .into_iter()
        .map(|v| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect())
}

/// True when the extension was built without optimisations (`maturin build` without
/// `--release`): the benchmark warns that its timings then mean little.
#[pyfunction]
fn debug_build() -> bool {
    cfg!(debug_assertions)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Spec>()?;
    m.add_class::<Worker>()?;
    m.add_class::<Staged>()?;
    m.add_class::<StepPush>()?;
    m.add_function(wrap_pyfunction!(run_ps, m)?)?;
    m.add_function(wrap_pyfunction!(bench_rust_push, m)?)?;
    m.add_function(wrap_pyfunction!(rust_push_pull, m)?)?;
    m.add_function(wrap_pyfunction!(debug_build, m)?)?;
    m.add("IbexError", py.get_type::<IbexError>())?;
    m.add(
        "UnknownVariableError",
        py.get_type::<UnknownVariableError>(),
    )?;
    m.add("ShapeMismatchError", py.get_type::<ShapeMismatchError>())?;
    m.add("StaleStepError", py.get_type::<StaleStepError>())?;
    m.add("PsTimeoutError", py.get_type::<PsTimeoutError>())?;
    m.add("UnavailableError", py.get_type::<UnavailableError>())?;
    m.add("RejectedError", py.get_type::<RejectedError>())?;
    m.add("DeadlineError", py.get_type::<DeadlineError>())?;
    m.add("BufferBusyError", py.get_type::<BufferBusyError>())?;
    m.add("SpecError", py.get_type::<SpecError>())?;
    Ok(())
}
