//! The engine a provider serves: its build (for the cache identity), the CPU it runs on, and
//! the weights-cache interface its XNNPACK speaks, told from the library loaded in this
//! process.

#![forbid(unsafe_code)]

use packd_interpose::identity::{file_build, library_at};
use packd_interpose::sys::Loaded;

pub use packd_interpose::identity::cpu_identity;

/// The build of the engine whose code lies at `addr`: the library's build
/// ([`file_build`]: its GNU build-id, or the BLAKE3 of the file) and XNNPACK's own build
/// identifier where the library exports it. `None` if no file maps `addr`.
pub fn engine_identity(addr: usize) -> Option<String> {
    let path = library_at(addr)?;
    let file_id = file_build(&path)?;
    Some(match Loaded::open(&path).and_then(|lib| crate::sys::build_identifier(&lib)) {
        Some(xnn) => format!("{file_id};xnn:{xnn}"),
        None => file_id,
    })
}

/// Why a loaded library's weights-cache interface is not one packd knows.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InterfaceError {
    #[error("no library is mapped at {0:#x}")]
    NoLibrary(usize),
    #[error("{0} is not a loaded library")]
    NotLoaded(String),
    #[error(
        "{0} exports no XNNPACK with a weights-cache provider (xnn_create_runtime_v4, \
         xnn_create_weights_cache_with_size)"
    )]
    NoProvider(String),
    #[error("{0} has alias_data but no fingerprint API: an XNNPACK packd does not know")]
    Unknown(String),
    /// More than one loaded library defines XNNPACK (their paths).
    #[error("more than one loaded library defines XNNPACK ({})", .0.join(", "))]
    Ambiguous(Vec<String>),
}

/// XNNPACK's weights-cache interfaces packd knows, by the year and month they appeared.
pub const INTERFACES: [u32; 3] = [202_411, 202_511, 202_603];

/// The weights-cache interface of the XNNPACK whose code lies at `addr`, told by the
/// symbols its library exports: `xnn_weights_cache_alias_data` came with `alias_data`
/// (2026-03), `xnn_check_fingerprint` with `fingerprint_id` (2025-11);
/// `xnn_create_weights_cache_with_size` and `xnn_create_runtime_v4` without them are the
/// 2024-11 interface. For a provider filled at run time, for an engine packd was not
/// compiled against (where `packd_xnnpack.h` checks the engine's header instead). An error
/// says why the library is not one packd knows.
pub fn engine_interface(addr: usize) -> Result<u32, InterfaceError> {
    let path = library_at(addr).ok_or(InterfaceError::NoLibrary(addr))?;
    let Some(lib) = Loaded::open(&path) else { return Err(InterfaceError::NotLoaded(path)) };
    let has = |name: &std::ffi::CStr| lib.has(name);
    if !has(c"xnn_create_runtime_v4") || !has(c"xnn_create_weights_cache_with_size") {
        return Err(InterfaceError::NoProvider(path));
    }
    Ok(match (has(c"xnn_check_fingerprint"), has(c"xnn_weights_cache_alias_data")) {
        (false, false) => 202_411,
        (true, false) => 202_511,
        (true, true) => 202_603,
        (false, true) => {
            return Err(InterfaceError::Unknown(path));
        }
    })
}
