//! `--device cuda`: the demo MLP on a GPU. Same math as [`crate::model::Mlp`] (input ->
//! hidden ReLU -> classes, softmax cross-entropy, batch-mean gradients): matrix products in
//! cuBLAS sgemm, the element-wise steps in small kernels compiled at start-up with NVRTC.
//! Parameters and gradients stay in device memory; the worker pushes the gradients and
//! pulls the fresh parameters through `ibex-worker`'s device staging path.
//!
//! Without the `cuda` feature, or without a usable GPU, asking for it is an error that says
//! what to install or rebuild.

use crate::data::Dataset;
use crate::model::{Mlp, Params};

/// Where the workers compute.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// Plain f32 on the CPU.
    #[default]
    Cpu,
    /// An NVIDIA GPU through CUDA (build with `--features cuda`).
    Cuda,
}

impl Device {
    /// The flag value.
    pub fn as_str(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }
}

/// Checks before starting processes that `device` can be used here.
pub fn ensure(device: Device) -> Result<(), String> {
    match device {
        Device::Cpu => Ok(()),
        #[cfg(feature = "cuda")]
        Device::Cuda => ibex_worker::device_count()
            .map_err(|e| format!("--device cuda: {e}"))
            .and_then(|n| {
                if n == 0 {
                    Err("--device cuda: the CUDA driver reports no device; check nvidia-smi".into())
                } else {
                    Ok(())
                }
            }),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => Err(NOT_BUILT.into()),
    }
}

/// Column-major (cuBLAS) GEMM arguments that compute the row-major product
/// C (m x n) = op(A) (m x k) * op(B) (k x n): cuBLAS sees each row-major matrix as its
/// transpose, so it computes C^T = op(B)^T op(A)^T, with B's buffer as its first operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct ColMajorGemm {
    /// Transpose cuBLAS's first operand (B's buffer).
    trans_first: bool,
    /// Transpose its second operand (A's buffer).
    trans_second: bool,
    m: usize,
    n: usize,
    k: usize,
    ld_first: usize,
    ld_second: usize,
    ldc: usize,
}

/// See [`ColMajorGemm`]; `ta`/`tb` say whether A/B are stored transposed (A as k x m, B as
/// n x k, row-major).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn row_major_gemm(ta: bool, tb: bool, m: usize, k: usize, n: usize) -> ColMajorGemm {
    ColMajorGemm {
        trans_first: tb,
        trans_second: ta,
        m: n,
        n: m,
        k,
        ld_first: if tb { k } else { n },
        ld_second: if ta { m } else { k },
        ldc: n,
    }
}

#[cfg(not(feature = "cuda"))]
const NOT_BUILT: &str = "--device cuda: this ibex was built without CUDA support; rebuild with \
                         `cargo build --release -p ibex-cluster --features cuda` (needs no CUDA toolkit to build; \
                         running needs the NVIDIA driver and the NVRTC and cuBLAS libraries of CUDA 12.4+)";

#[cfg(not(feature = "cuda"))]
pub use cpu_only::Trainer;

#[cfg(not(feature = "cuda"))]
mod cpu_only {
    use super::*;

    /// A GPU trainer; none can exist in a build without the `cuda` feature (the type has no
    /// values), so the training loop's GPU branch is statically dead here.
    pub enum Trainer {}

    impl Trainer {
        /// `None` for the CPU; an error naming the missing feature for CUDA.
        pub fn open(_mlp: Mlp, device: Device, _batch: usize) -> Result<Option<Trainer>, String> {
            ensure(device).map(|()| None)
        }

        /// Unreachable: no `Trainer` exists.
        pub fn load(&mut self, _p: &Params) -> Result<(), String> {
            match *self {}
        }

        /// Unreachable: no `Trainer` exists.
        pub fn params(&self) -> Result<Params, String> {
            match *self {}
        }

        /// Unreachable: no `Trainer` exists.
        pub async fn step(
            &mut self,
            _w: &ibex_worker::Worker,
            _step: u64,
            _batch: &Dataset,
        ) -> Result<f32, ibex_worker::WorkerError> {
            match *self {}
        }
    }
}

#[cfg(feature = "cuda")]
pub use gpu_impl::Trainer;

#[cfg(feature = "cuda")]
mod gpu_impl {
    use std::sync::Arc;

    use ibex_worker::cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
    use ibex_worker::cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
    use ibex_worker::cudarc::nvrtc;
    use ibex_worker::{Gpu, Worker, WorkerError};

    use super::*;

    const KERNELS: &str = r#"
extern "C" __global__ void bias_act(float* a, const float* b, int rows, int cols, int relu) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * cols) {
        float v = a[i] + b[i % cols];
        a[i] = (relu && v < 0.0f) ? 0.0f : v;
    }
}
// One thread per example: softmax in place, the loss, then dL/dz = (p - onehot) * scale.
extern "C" __global__ void softmax_xent(float* z, const int* y, float* loss, int rows, int cols, float scale) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float* zr = z + (long)r * cols;
    float m = -3.402823466e+38f;
    for (int c = 0; c < cols; c++) m = fmaxf(m, zr[c]);
    float s = 0.0f;
    for (int c = 0; c < cols; c++) { float e = expf(zr[c] - m); zr[c] = e; s += e; }
    for (int c = 0; c < cols; c++) zr[c] /= s;
    int lab = y[r];
    loss[r] = -logf(fmaxf(zr[lab], 1.17549435e-38f));
    zr[lab] -= 1.0f;
    for (int c = 0; c < cols; c++) zr[c] *= scale;
}
// ReLU passes the gradient only where the unit was active.
extern "C" __global__ void relu_grad(float* dh, const float* h, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && h[i] <= 0.0f) dh[i] = 0.0f;
}
extern "C" __global__ void col_sum(const float* a, float* out, int rows, int cols) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float s = 0.0f;
    for (int r = 0; r < rows; r++) s += a[(long)r * cols + c];
    out[c] = s;
}
"#;

    fn cuda(op: &str, e: impl std::fmt::Debug) -> String {
        format!("--device cuda: {op} failed: {e:?}")
    }

    fn worker_err(e: WorkerError) -> String {
        format!("--device cuda: {e}")
    }

    fn grid(n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (n.div_ceil(256).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn int(n: usize) -> Result<i32, String> {
        i32::try_from(n)
            .map_err(|_| format!("--device cuda: dimension {n} does not fit a kernel argument"))
    }

    struct Kernels {
        bias_act: CudaFunction,
        softmax_xent: CudaFunction,
        relu_grad: CudaFunction,
        col_sum: CudaFunction,
    }

    /// The MLP's parameters, gradients and activations in device memory.
    pub struct Trainer {
        gpu: Arc<Gpu>,
        blas: CudaBlas,
        k: Kernels,
        mlp: Mlp,
        cap: usize,
        params: Vec<CudaSlice<f32>>,
        grads: Vec<CudaSlice<f32>>,
        x: CudaSlice<f32>,
        y: CudaSlice<i32>,
        h: CudaSlice<f32>,
        z: CudaSlice<f32>,
        dh: CudaSlice<f32>,
        loss: CudaSlice<f32>,
    }

    impl Trainer {
        /// `None` for the CPU; for CUDA, opens device 0, compiles the kernels and allocates
        /// everything for minibatches of up to `batch` examples.
        pub fn open(mlp: Mlp, device: Device, batch: usize) -> Result<Option<Trainer>, String> {
            if device == Device::Cpu {
                return Ok(None);
            }
            ensure(device)?;
            let gpu = Arc::new(Gpu::open(0).map_err(worker_err)?);
            // SAFETY: only dlopens the candidate names.
            if !unsafe { nvrtc::sys::is_culib_present() } {
                return Err("--device cuda: NVRTC (libnvrtc.so, part of the CUDA toolkit 12.4+) cannot be loaded; \
                            install the toolkit or add its lib64 directory to LD_LIBRARY_PATH"
                    .into());
            }
            // SAFETY: as above.
            if !unsafe { ibex_worker::cudarc::cublas::sys::is_culib_present() } {
                return Err("--device cuda: cuBLAS (libcublas.so, CUDA toolkit 12.4+) cannot be loaded; install \
                            it or add its directory to LD_LIBRARY_PATH"
                    .into());
            }
            let ptx = nvrtc::compile_ptx(KERNELS).map_err(|e| cuda("NVRTC compile", e))?;
            let module = gpu
                .context()
                .load_module(ptx)
                .map_err(|e| cuda("cuModuleLoadData", e))?;
            let f = |name: &str| {
                module
                    .load_function(name)
                    .map_err(|e| cuda("cuModuleGetFunction", e))
            };
            let k = Kernels {
                bias_act: f("bias_act")?,
                softmax_xent: f("softmax_xent")?,
                relu_grad: f("relu_grad")?,
                col_sum: f("col_sum")?,
            };
            let blas = CudaBlas::new(gpu.stream().clone()).map_err(|e| cuda("cublasCreate", e))?;
            let z = |n: usize| gpu.alloc_zeros(n).map_err(worker_err);
            let sizes: Vec<usize> = mlp.shapes().iter().map(|s| s.iter().product()).collect();
            let params = sizes.iter().map(|&n| z(n)).collect::<Result<Vec<_>, _>>()?;
            let grads = sizes.iter().map(|&n| z(n)).collect::<Result<Vec<_>, _>>()?;
            let y = gpu
                .stream()
                .alloc_zeros::<i32>(batch)
                .map_err(|e| cuda("cuMemAlloc", e))?;
            let t = Trainer {
                x: z(batch * mlp.input)?,
                h: z(batch * mlp.hidden)?,
                z: z(batch * mlp.classes)?,
                dh: z(batch * mlp.hidden)?,
                loss: z(batch)?,
                y,
                gpu: gpu.clone(),
                blas,
                k,
                mlp,
                cap: batch,
                params,
                grads,
            };
            eprintln!("device: {:?}", gpu.paths());
            Ok(Some(t))
        }

        /// Copies host parameters (from a pull) to the device.
        pub fn load(&mut self, p: &Params) -> Result<(), String> {
            self.mlp.check(p)?;
            for (d, h) in self.params.iter_mut().zip(p) {
                self.gpu
                    .stream()
                    .memcpy_htod(h.as_slice(), d)
                    .map_err(|e| cuda("cuMemcpyHtoD", e))?;
            }
            Ok(())
        }

        /// The device parameters, copied to the host.
        pub fn params(&self) -> Result<Params, String> {
            self.params
                .iter()
                .map(|d| self.gpu.download(d).map_err(worker_err))
                .collect()
        }

        /// C (m x n) = op(A) (m x k) * op(B) (k x n), all row-major, through column-major
        /// cuBLAS as C^T = op(B)^T op(A)^T.
        #[allow(clippy::too_many_arguments)]
        fn gemm(
            blas: &CudaBlas,
            a: &CudaSlice<f32>,
            ta: bool,
            b: &CudaSlice<f32>,
            tb: bool,
            c: &mut CudaSlice<f32>,
            (m, k, n): (usize, usize, usize),
        ) -> Result<(), String> {
            let op = |t: bool| {
                if t {
                    cublasOperation_t::CUBLAS_OP_T
                } else {
                    cublasOperation_t::CUBLAS_OP_N
                }
            };
            let g = row_major_gemm(ta, tb, m, k, n);
            let cfg = GemmConfig {
                transa: op(g.trans_first),
                transb: op(g.trans_second),
                m: int(g.m)?,
                n: int(g.n)?,
                k: int(g.k)?,
                alpha: 1.0f32,
                lda: int(g.ld_first)?,
                ldb: int(g.ld_second)?,
                beta: 0.0f32,
                ldc: int(g.ldc)?,
            };
            // SAFETY: the operands hold at least m*k, k*n and m*n values (sized at `open`
            // for `cap` rows; `step` checks the batch against it).
            unsafe { blas.gemm(cfg, b, a, c) }.map_err(|e| cuda("cublasSgemm", e))
        }

        /// One sync step: forward and backward on the device for `batch`, then the gradients
        /// go to the PS and the fresh parameters come back into device memory. Returns the
        /// batch's mean loss.
        pub async fn step(
            &mut self,
            w: &Worker,
            step: u64,
            batch: &Dataset,
        ) -> Result<f32, WorkerError> {
            let n = batch.len();
            let loss = self.compute(batch).map_err(|e| WorkerError::Cuda {
                op: "training step".into(),
                code: e,
            })?;
            let g = &self.grads;
            let grads: Vec<(&str, &CudaSlice<f32>)> =
                Mlp::NAMES.iter().copied().zip(g.iter()).collect();
            let mut params: Vec<&mut CudaSlice<f32>> = self.params.iter_mut().collect();
            w.push_pull_device(&self.gpu, step, &grads, &mut params)
                .await?;
            Ok(if n == 0 { 0.0 } else { loss })
        }

        fn compute(&mut self, batch: &Dataset) -> Result<f32, String> {
            let n = batch.len();
            let (d, hdim, c) = (self.mlp.input, self.mlp.hidden, self.mlp.classes);
            if n > self.cap || batch.dim != d {
                return Err(format!(
                    "batch of {n} x {} does not fit the {} x {d} buffers",
                    batch.dim, self.cap
                ));
            }
            if n == 0 {
                for g in &mut self.grads {
                    self.gpu
                        .stream()
                        .memset_zeros(g)
                        .map_err(|e| cuda("cuMemsetD8", e))?;
                }
                return Ok(0.0);
            }
            let s = self.gpu.stream().clone();
            s.memcpy_htod(batch.x.as_slice(), &mut self.x)
                .map_err(|e| cuda("cuMemcpyHtoD", e))?;
            let labels: Vec<i32> = batch.y.iter().map(|&l| i32::from(l)).collect();
            s.memcpy_htod(labels.as_slice(), &mut self.y)
                .map_err(|e| cuda("cuMemcpyHtoD", e))?;
            let (ni, hi, ci) = (int(n)?, int(hdim)?, int(c)?);
            let (relu, linear, scale) = (1i32, 0i32, 1.0f32 / n as f32);
            let [w1, b1, w2, b2] = &self.params[..] else {
                return Err("the MLP has four tensors".into());
            };
            // Forward: h = relu(x w1 + b1); z = h w2 + b2.
            Self::gemm(
                &self.blas,
                &self.x,
                false,
                w1,
                false,
                &mut self.h,
                (n, d, hdim),
            )?;
            let launch = |r: Result<(), _>| r.map_err(|e| cuda("cuLaunchKernel", e));
            // SAFETY (every launch below): the kernels index only below rows*cols of buffers
            // sized for `cap` >= n rows, and take the argument types passed here.
            launch(unsafe {
                s.launch_builder(&self.k.bias_act)
                    .arg(&mut self.h)
                    .arg(b1)
                    .arg(&ni)
                    .arg(&hi)
                    .arg(&relu)
                    .launch(grid(n * hdim))
                    .map(drop)
            })?;
            Self::gemm(
                &self.blas,
                &self.h,
                false,
                w2,
                false,
                &mut self.z,
                (n, hdim, c),
            )?;
            launch(unsafe {
                s.launch_builder(&self.k.bias_act)
                    .arg(&mut self.z)
                    .arg(b2)
                    .arg(&ni)
                    .arg(&ci)
                    .arg(&linear)
                    .launch(grid(n * c))
                    .map(drop)
            })?;
            // z becomes dL/dz.
            launch(unsafe {
                s.launch_builder(&self.k.softmax_xent)
                    .arg(&mut self.z)
                    .arg(&self.y)
                    .arg(&mut self.loss)
                    .arg(&ni)
                    .arg(&ci)
                    .arg(&scale)
                    .launch(grid(n))
                    .map(drop)
            })?;
            // Backward.
            let [gw1, gb1, gw2, gb2] = &mut self.grads[..] else {
                return Err("the MLP has four tensors".into());
            };
            Self::gemm(&self.blas, &self.h, true, &self.z, false, gw2, (hdim, n, c))?;
            launch(unsafe {
                s.launch_builder(&self.k.col_sum)
                    .arg(&self.z)
                    .arg(gb2)
                    .arg(&ni)
                    .arg(&ci)
                    .launch(grid(c))
                    .map(drop)
            })?;
            Self::gemm(
                &self.blas,
                &self.z,
                false,
                w2,
                true,
                &mut self.dh,
                (n, c, hdim),
            )?;
            let nh = int(n * hdim)?;
            launch(unsafe {
                s.launch_builder(&self.k.relu_grad)
                    .arg(&mut self.dh)
                    .arg(&self.h)
                    .arg(&nh)
                    .launch(grid(n * hdim))
                    .map(drop)
            })?;
            Self::gemm(
                &self.blas,
                &self.x,
                true,
                &self.dh,
                false,
                gw1,
                (d, n, hdim),
            )?;
            launch(unsafe {
                s.launch_builder(&self.k.col_sum)
                    .arg(&self.dh)
                    .arg(gb1)
                    .arg(&ni)
                    .arg(&hi)
                    .launch(grid(hdim))
                    .map(drop)
            })?;
            let losses = s
                .clone_dtoh(&self.loss.slice(0..n))
                .map_err(|e| cuda("cuMemcpyDtoH", e))?;
            Ok((losses.iter().map(|&l| f64::from(l)).sum::<f64>() / n as f64) as f32)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// BLAS sgemm semantics, column-major: C = op(A) op(B), op(A) m x k, op(B) k x n.
    #[allow(clippy::too_many_arguments)]
    fn sgemm_col_major(
        ta: bool,
        tb: bool,
        m: usize,
        n: usize,
        k: usize,
        a: &[f32],
        lda: usize,
        b: &[f32],
        ldb: usize,
        c: &mut [f32],
        ldc: usize,
    ) {
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0;
                for p in 0..k {
                    let x = if ta { a[p + i * lda] } else { a[i + p * lda] };
                    let y = if tb { b[j + p * ldb] } else { b[p + j * ldb] };
                    s += x * y;
                }
                c[i + j * ldc] = s;
            }
        }
    }

    /// The argument mapping the GPU model hands cuBLAS gives the row-major products the
    /// CPU model computes, for every transpose combination it uses (and the fourth).
    #[test]
    fn row_major_gemm_through_column_major_blas() {
        let (m, k, n) = (3, 4, 5);
        let val = |i: usize| ((i * 7) % 11) as f32 - 5.0;
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            // Logical A (m x k) and B (k x n), row-major.
            let a: Vec<f32> = (0..m * k).map(val).collect();
            let b: Vec<f32> = (0..k * n).map(|i| val(i + 3)).collect();
            // How they are stored: transposed when ta / tb.
            let a_st: Vec<f32> = if ta {
                (0..k * m).map(|i| a[(i % m) * k + i / m]).collect()
            } else {
                a.clone()
            };
            let b_st: Vec<f32> = if tb {
                (0..n * k).map(|i| b[(i % k) * n + i / k]).collect()
            } else {
                b.clone()
            };
            let g = row_major_gemm(ta, tb, m, k, n);
            let mut c = vec![0.0; m * n];
            sgemm_col_major(
                g.trans_first,
                g.trans_second,
                g.m,
                g.n,
                g.k,
                &b_st,
                g.ld_first,
                &a_st,
                g.ld_second,
                &mut c,
                g.ldc,
            );
            for i in 0..m {
                for j in 0..n {
                    let want: f32 = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
                    assert_eq!(c[i * n + j], want, "ta {ta} tb {tb} at ({i}, {j})");
                }
            }
        }
    }

    #[test]
    fn the_cpu_needs_no_trainer() {
        let mlp = Mlp {
            input: 4,
            hidden: 3,
            classes: 2,
        };
        assert!(Trainer::open(mlp, Device::Cpu, 8).unwrap().is_none());
        assert_eq!(ensure(Device::Cpu), Ok(()));
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_says_how_to_rebuild() {
        let e = ensure(Device::Cuda).unwrap_err();
        assert!(e.contains("--features cuda"), "{e}");
        let mlp = Mlp {
            input: 4,
            hidden: 3,
            classes: 2,
        };
        assert!(Trainer::open(mlp, Device::Cuda, 8).is_err());
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_without_a_driver_says_what_to_install() {
        if ibex_worker::probe_driver().is_ok() {
            println!(
                "skipped: a CUDA driver is installed here; this test checks the refusal without one"
            );
            return;
        }
        let e = ensure(Device::Cuda).unwrap_err();
        assert!(e.contains("install the NVIDIA driver"), "{e}");
        let mlp = Mlp {
            input: 4,
            hidden: 3,
            classes: 2,
        };
        assert!(Trainer::open(mlp, Device::Cuda, 8).is_err());
    }
}
