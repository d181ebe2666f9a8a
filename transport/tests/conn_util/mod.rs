//! Helpers shared by the connection test binaries (a directory module, so cargo does not
//! build it as a test of its own).

use bytes::Bytes;
use ibex_transport::Config;

/// A recognisable payload: byte i is `i * 31 + seed`.
pub fn pattern(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect::<Vec<u8>>()
        .into()
}

/// The default configuration with a fixed eager threshold (no connect-time probe).
pub fn fixed_threshold(t: usize) -> Config {
    Config {
        eager_threshold: Some(t),
        ..Config::default()
    }
}

/// A listen address for `provider`, unique per process and `tag`.
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
