//! The config file is read at start and at every reload: whatever it holds, parsing and
//! validation must not panic, and a config that is accepted must hold its invariants.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use packd::config::{Args, Config};

fn dir() -> &'static std::path::Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("temp dir")).path()
}

fuzz_target!(|data: &[u8]| {
    let path = dir().join("packd.toml");
    std::fs::write(&path, data).expect("write the config file");
    let args = <Args as clap::Parser>::try_parse_from([
        "packd".as_ref(),
        "--config".as_ref(),
        path.as_os_str(),
    ])
    .expect("arguments");
    // Without a socket_dir in the file the default resolution applies; both are fine.
    if let Ok(c) = Config::from_args(args) {
        assert!(c.max_bytes > 0);
        assert!(c.digest_cache > 0);
        assert!(c.socket_mode <= 0o777 && c.socket_mode & 0o600 == 0o600);
        assert!(!c.socket_dir.as_os_str().is_empty());
        assert!(c.limits.max_connections > 0);
    }
});
