//! The steady state of a ps-step-like loop allocates no large buffer of its own: after
//! warm-up, a step (pull every variable into the same vectors, push every gradient) over
//! shm asks the allocator for no block of 64 KiB or more in the worker library or in the PS
//! (both run in this process, so one counting allocator sees both). Fresh large buffers
//! every step cost a page fault per 4 KiB touched, about a quarter of a ResNet-50 step.
//!
//! Pulls too: values of at least the connection's `remote_min` (256 KiB here) come back as descriptors of the PS's pooled
//! snapshots, read one-sided into the caller's vectors, so no response body carries them.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use ibex_worker::{Dtype, Init, Optimizer, TransportKind, VarSpec};

const LARGE: usize = 64 << 10;
/// Counts blocks of at least [`LARGE`] bytes (fresh, or grown to that size) while armed.
struct Counting;

static ARMED: AtomicBool = AtomicBool::new(false);
static LARGE_ALLOCS: AtomicU64 = AtomicU64::new(0);
/// The size of the last large block counted, for the failure message.
static LAST_SIZE: AtomicUsize = AtomicUsize::new(0);

fn count(size: usize) {
    if size >= LARGE && ARMED.load(Ordering::Relaxed) {
        LARGE_ALLOCS.fetch_add(1, Ordering::Relaxed);
        LAST_SIZE.store(size, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded unchanged to the system allocator; counting touches only
// atomics and never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        count(l.size());
        // SAFETY: the caller's contract for `alloc` is passed on as is.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        count(l.size());
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: as for `alloc`.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        if new > l.size() {
            count(new);
        }
        // SAFETY: as for `alloc`.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn var(name: &str, shape: &[usize]) -> VarSpec {
    VarSpec {
        name: name.into(),
        dtype: Dtype::F32,
        shape: shape.to_vec(),
        init: Init::Zeros,
        optimizer: Optimizer::Momentum {
            lr: 0.1,
            momentum: 0.9,
        },
        sparse: false,
    }
}

/// Large allocations during `f`.
async fn large_allocs<T>(f: impl Future<Output = T>) -> (u64, T) {
    let before = LARGE_ALLOCS.load(Ordering::Relaxed);
    ARMED.store(true, Ordering::Relaxed);
    let r = f.await;
    ARMED.store(false, Ordering::Relaxed);
    (LARGE_ALLOCS.load(Ordering::Relaxed) - before, r)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_ps_step_allocates_no_large_buffer() {
    let (spec, _stops) = common::start_sync_ps(TransportKind::Shm, 2, 1);
    let w = common::connect_worker(&spec, 0).await.unwrap();
    // A split variable (two parts on two PS), whole ones on either PS, and a small one.
    let vars = [
        var("fc", &[640, 512]),
        var("conv", &[256, 512]),
        var("conv2", &[128, 512]),
        var("bias", &[512]),
    ];
    w.create_variables(&vars).await.unwrap();
    let names: Vec<&str> = vars.iter().map(|v| v.name.as_str()).collect();
    let grads: Vec<Vec<f32>> = vars.iter().map(|v| vec![0.5; v.numel()]).collect();
    let pairs: Vec<(&str, &[f32])> = names
        .iter()
        .copied()
        .zip(grads.iter().map(Vec::as_slice))
        .collect();
    let mut values: Vec<Vec<f32>> = vec![Vec::new(); names.len()];
    const WARMUP: u64 = 3;
    for step in 0..WARMUP + 5 {
        let (pull, r) = large_allocs(w.pull_into(&names, step, &mut values)).await;
        r.unwrap();
        let (push, r) = large_allocs(w.push(step, &pairs)).await;
        r.unwrap();
        if step >= WARMUP {
            let last = LAST_SIZE.load(Ordering::Relaxed);
            assert_eq!(
                push, 0,
                "step {step}: the push allocated {push} blocks of >= 64 KiB (last {last} B)"
            );
            assert_eq!(
                pull, 0,
                "step {step}: the pull allocated {pull} blocks of >= 64 KiB (last {last} B)"
            );
        }
    }
    // The loop really trained: v = 0.5, 0.95, 1.355, ...; w = -0.1 * sum(v).
    w.pull_into(&names, WARMUP + 5, &mut values).await.unwrap();
    let mut v = 0f32;
    let mut expect = 0f32;
    for _ in 0..WARMUP + 5 {
        v = 0.9 * v + 0.5;
        expect -= 0.1 * v;
    }
    for (n, x) in names.iter().zip(&values) {
        assert!(
            x.iter().all(|&y| (y - expect).abs() < 1e-5),
            "{n}: {} vs {expect}",
            x[0]
        );
    }
}
