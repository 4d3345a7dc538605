//! What packctl prints on stdout.

use std::io::Write;

/// Writes `text` to stdout; a closed pipe (`packctl … | head`) is not an error, any other
/// failure (a full disk) ends packctl with it.
pub fn emit(text: &str) {
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(text.as_bytes()).and_then(|()| out.flush())
        && e.kind() != std::io::ErrorKind::BrokenPipe
    {
        eprintln!("packctl: writing the output failed: {e}");
        std::process::exit(1);
    }
}
