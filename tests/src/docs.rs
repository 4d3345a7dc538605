//! Running the documents' commands as a user types them: a shell with a fresh `$HOME`, the
//! commands read from the documents themselves (so a document that changes is tested as it
//! reads).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// A shell in `cwd` with `home` as `$HOME` (cargo and rustup keep theirs) and a clean
/// packd environment; builds go where this workspace's builds go.
pub fn shell(home: &Path, cwd: &Path, script: &str) -> Command {
    let real_home = PathBuf::from(std::env::var_os("HOME").expect("HOME"));
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg(format!("set -e\n{script}")).current_dir(cwd).env("HOME", home);
    cmd.env("CARGO_HOME", std::env::var_os("CARGO_HOME").map_or(real_home.join(".cargo"), PathBuf::from));
    cmd.env("RUSTUP_HOME", std::env::var_os("RUSTUP_HOME").map_or(real_home.join(".rustup"), PathBuf::from));
    for var in ["PACKD_CONFIG", "PACKD_CACHE_DIR", "PACKD_SOCKET_DIR", "CACHE_DIRECTORY", "STATE_DIRECTORY"] {
        cmd.env_remove(var);
    }
    cmd.env("CARGO_TARGET_DIR", crate::bins::bin_dir().parent().expect("target dir"));
    cmd
}

/// Runs `cmd`, failing with its output unless it succeeds; returns stdout and stderr.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run sh");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "failed:\n{text}");
    text
}

/// The lines of the fenced block that follows `marker` in `doc`.
pub fn block_after(doc: &str, marker: &str) -> Vec<String> {
    let text = std::fs::read_to_string(root().join(doc)).expect("read doc");
    let start = text.find(marker).unwrap_or_else(|| panic!("no {marker:?} in {doc}"));
    let rest = &text[start..];
    let open = rest.find("```").expect("a fenced block") + 3;
    let body = &rest[open..];
    let body = &body[body.find('\n').expect("fence line") + 1..];
    let end = body.find("```").expect("closing fence");
    body[..end].lines().map(str::to_string).filter(|l| !l.trim().is_empty()).collect()
}

/// The indented (4-space) command lines of `doc` from `marker` to the next blank line after
/// the first one, without their `# comments`.
pub fn indented_after(doc: &str, marker: &str) -> Vec<String> {
    let text = std::fs::read_to_string(root().join(doc)).expect("read doc");
    let start = text.find(marker).unwrap_or_else(|| panic!("no {marker:?} in {doc}"));
    text[start..]
        .lines()
        .skip_while(|l| !l.starts_with("    "))
        .take_while(|l| l.starts_with("    "))
        .map(command_of)
        .filter(|c| !c.is_empty())
        .collect()
}

/// A shell command without its trailing `# comment`.
pub fn command_of(line: &str) -> String {
    line.split("  #").next().unwrap_or(line).trim().to_string()
}
