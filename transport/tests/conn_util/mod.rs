//! Helpers shared by the connection test binaries (a directory module, so cargo does not
//! build it as a test of its own).

use ibex_transport::Config;

/// Logs to the test's output, filtered by `RUST_LOG` (nothing without it); safe to call
/// from every test.
#[allow(dead_code)] // not every test binary that shares this module logs
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

#[allow(unused_imports)] // not every test binary that shares this module sends patterns
pub use ibex_test_support::pattern;

/// The default configuration with a fixed eager threshold and the default fragment size
/// fixed too, so that no connect-time probe runs.
pub fn fixed_threshold(t: usize) -> Config {
    let c = Config::from_env()
        // The environment's timeouts (the Soft-RoCE VM raises the set-up deadline, since
        // emulated verbs set-up takes seconds); a bad value fails loudly.
        .expect("IBEX_* environment variables");
    Config {
        eager_threshold: Some(t),
        fragment_size: Some(c.default_fragment_size),
        ..c
    }
}

/// A listen address for `provider`, unique per process and `tag`.
#[allow(dead_code)] // not every test binary that shares this module listens on one
pub fn uri(provider: &str, tag: &str) -> String {
    match provider {
        "shm" => {
            let p =
                std::env::temp_dir().join(format!("ibex-test-{}-{tag}.sock", std::process::id()));
            format!("shm://{}", p.display())
        }
        // In the Soft-RoCE VM (scripts/verbs-test.sh) the harness says where and on which
        // devices; two hosts = two rxe devices across a veth.
        "verbs" => format!(
            "verbs://{}",
            std::env::var("IBEX_TEST_LISTEN_ADDR").unwrap_or_else(|_| "127.0.0.1:0".into())
        ),
        _ => "tcp://127.0.0.1:0".to_string(),
    }
}
