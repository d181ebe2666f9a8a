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

/// The answer each honest round trip must get within.
#[allow(dead_code)] // for the listener flood tests
pub const ANSWERED_WITHIN: std::time::Duration = std::time::Duration::from_secs(1);
/// How often the honest peer comes back, and how many times.
#[allow(dead_code)]
pub const HONEST_EVERY: std::time::Duration = std::time::Duration::from_millis(250);
#[allow(dead_code)]
pub const HONEST_ROUNDS: u32 = 12;

/// An honest peer under attack: every [`HONEST_EVERY`], [`HONEST_ROUNDS`] times, a fresh
/// connection to `at` and one echoed round trip, each answered within [`ANSWERED_WITHIN`]
/// or the test fails. Returns each round's time.
#[allow(dead_code)]
pub async fn honest_rounds(at: &str, cfg: &Config) -> Vec<std::time::Duration> {
    let mut times = Vec::new();
    for round in 0..HONEST_ROUNDS {
        let t = std::time::Instant::now();
        let r = tokio::time::timeout(ANSWERED_WITHIN, async {
            let c = ibex_transport::connect(at, cfg.clone()).await?;
            c.send(bytes::Bytes::from(round.to_le_bytes().to_vec()))
                .await?;
            let got = c.recv().await?;
            assert_eq!(&got[..], &round.to_le_bytes());
            Ok::<(), ibex_transport::Error>(())
        })
        .await;
        let took = t.elapsed();
        match r {
            Ok(Ok(())) => times.push(took),
            Ok(Err(e)) => panic!("honest round {round} failed after {took:?}: {e}"),
            Err(_) => panic!("honest round {round} had no answer within {ANSWERED_WITHIN:?}"),
        }
        tokio::time::sleep(HONEST_EVERY.saturating_sub(took)).await;
    }
    times
}
