//! The parts of ggml's structures the integration reads or writes, declared for the one ggml
//! it supports: ggml 0.25.3 as vendored by llama.cpp 0c1e570 (PyPI's llama-cpp-python
//! 0.3.36). `struct ggml_tensor` is public (`ggml.h`); `struct ggml_backend_buffer` and its
//! function table are ggml's private interface (`ggml-backend-impl.h`) and change between
//! versions (0.25 added the 2-D copies), so nothing here is used unless the running
//! library says it is [`SUPPORTED_VERSION`]. `tests/tests/llama.rs` compiles the offsets
//! below against that version's own headers and compares.

#![forbid(unsafe_code)]

use std::ffi::c_void;

/// `ggml_version()` of the only ggml this integration is built for.
pub const SUPPORTED_VERSION: &str = "0.25.3";
/// What the supported version is vendored in, for messages.
pub const SUPPORTED_FROM: &str = "llama.cpp 0c1e570, as in llama-cpp-python 0.3.36";

/// `GGML_MAX_DIMS`.
pub const MAX_DIMS: usize = 4;
/// `GGML_MAX_NAME`.
pub const MAX_NAME: usize = 64;
/// `GGML_MAX_SRC`.
const MAX_SRC: usize = 10;
/// `GGML_MAX_OP_PARAMS` / 4.
const OP_PARAMS: usize = 16;

/// A buffer handle (`ggml_backend_buffer_t`).
pub type BufferPtr = *mut Buffer;
/// A buffer type handle (`ggml_backend_buffer_type_t`), never looked into.
pub type BufferTypePtr = *mut c_void;
/// A tensor handle.
pub type TensorPtr = *mut Tensor;

/// `struct ggml_backend_buffer_i` (ggml-backend-impl.h).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BufferIface {
    pub free_buffer: Option<unsafe extern "C" fn(BufferPtr)>,
    pub get_base: Option<unsafe extern "C" fn(BufferPtr) -> *mut c_void>,
    pub init_tensor: Option<unsafe extern "C" fn(BufferPtr, TensorPtr) -> i32>,
    pub memset_tensor: Option<unsafe extern "C" fn(BufferPtr, TensorPtr, u8, usize, usize)>,
    pub set_tensor: Option<unsafe extern "C" fn(BufferPtr, TensorPtr, *const c_void, usize, usize)>,
    pub get_tensor: Option<unsafe extern "C" fn(BufferPtr, *const Tensor, *mut c_void, usize, usize)>,
    pub set_tensor_2d: Option<unsafe extern "C" fn()>,
    pub get_tensor_2d: Option<unsafe extern "C" fn()>,
    pub cpy_tensor: Option<unsafe extern "C" fn(BufferPtr, *const Tensor, TensorPtr) -> bool>,
    pub clear: Option<unsafe extern "C" fn(BufferPtr, u8)>,
    pub reset: Option<unsafe extern "C" fn(BufferPtr)>,
}

/// `struct ggml_backend_buffer` (ggml-backend-impl.h).
#[repr(C)]
pub struct Buffer {
    pub iface: BufferIface,
    pub buft: BufferTypePtr,
    pub context: *mut c_void,
    pub size: usize,
    pub usage: i32,
}

/// `struct ggml_tensor` (ggml.h).
#[repr(C)]
pub struct Tensor {
    pub type_: i32,
    pub buffer: BufferPtr,
    pub ne: [i64; MAX_DIMS],
    pub nb: [usize; MAX_DIMS],
    pub op: i32,
    pub op_params: [i32; OP_PARAMS],
    pub flags: i32,
    pub src: [TensorPtr; MAX_SRC],
    pub view_src: TensorPtr,
    pub view_offs: usize,
    pub data: *mut c_void,
    pub name: [u8; MAX_NAME],
    pub extra: *mut c_void,
    pub padding: [u8; 8],
}

/// The layout facts `tests/tests/llama.rs` checks against the supported version's headers:
/// `(what, value)` pairs, printed by that test's C program in the same order.
pub fn layout() -> Vec<(&'static str, usize)> {
    use std::mem::{offset_of, size_of};
    vec![
        ("sizeof(struct ggml_backend_buffer_i)", size_of::<BufferIface>()),
        ("offsetof(ggml_backend_buffer_i, set_tensor)", offset_of!(BufferIface, set_tensor)),
        ("offsetof(ggml_backend_buffer_i, cpy_tensor)", offset_of!(BufferIface, cpy_tensor)),
        ("offsetof(ggml_backend_buffer_i, clear)", offset_of!(BufferIface, clear)),
        ("offsetof(ggml_backend_buffer_i, reset)", offset_of!(BufferIface, reset)),
        ("sizeof(struct ggml_backend_buffer)", size_of::<Buffer>()),
        ("offsetof(ggml_backend_buffer, buft)", offset_of!(Buffer, buft)),
        ("offsetof(ggml_backend_buffer, context)", offset_of!(Buffer, context)),
        ("offsetof(ggml_backend_buffer, size)", offset_of!(Buffer, size)),
        ("offsetof(ggml_backend_buffer, usage)", offset_of!(Buffer, usage)),
        ("sizeof(struct ggml_tensor)", size_of::<Tensor>()),
        ("offsetof(ggml_tensor, buffer)", offset_of!(Tensor, buffer)),
        ("offsetof(ggml_tensor, ne)", offset_of!(Tensor, ne)),
        ("offsetof(ggml_tensor, nb)", offset_of!(Tensor, nb)),
        ("offsetof(ggml_tensor, view_src)", offset_of!(Tensor, view_src)),
        ("offsetof(ggml_tensor, data)", offset_of!(Tensor, data)),
        ("offsetof(ggml_tensor, name)", offset_of!(Tensor, name)),
        ("offsetof(ggml_tensor, extra)", offset_of!(Tensor, extra)),
    ]
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::process::Command;

    fn root() -> PathBuf {
        std::env::var_os("LLAMA_ROOT")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/cache/llama/root"))
    }

    /// The offsets and sizes declared here are those of the supported ggml's own headers,
    /// compiled by the C compiler.
    #[test]
    #[cfg_attr(
        not(packd_llama),
        ignore = "needs a llama.cpp root with ggml's private headers: run .ci/run, or set LLAMA_ROOT \
                  (examples/llama/fetch-llama)"
    )]
    fn the_declared_layout_is_the_supported_headers_layout() {
        let ours = super::layout();
        let mut c = String::from(
            "#include <stdio.h>\n#include <stddef.h>\n#include \"ggml.h\"\n#include \"ggml-backend-impl.h\"\nint main(void) {\n",
        );
        for (what, _) in &ours {
            let expr = if let Some(rest) = what.strip_prefix("offsetof(") {
                let (ty, field) = rest.trim_end_matches(')').split_once(", ").expect("offsetof(type, field)");
                format!("offsetof(struct {ty}, {field})")
            } else {
                what.to_string()
            };
            c.push_str(&format!("    printf(\"%zu\\n\", (size_t){expr});\n"));
        }
        c.push_str("    return 0;\n}\n");
        let dir = std::env::temp_dir().join(format!("packd-llama-layout-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("layout.c"), c).unwrap();
        let root = root();
        let built = Command::new("cc")
            .arg(dir.join("layout.c"))
            .arg("-I")
            .arg(root.join("include"))
            .arg("-I")
            .arg(root.join("include/ggml-private"))
            .arg("-o")
            .arg(dir.join("layout"))
            .output()
            .expect("run cc");
        assert!(built.status.success(), "cc: {}", String::from_utf8_lossy(&built.stderr));
        let out = Command::new(dir.join("layout")).output().expect("run the layout program");
        let theirs: Vec<usize> = String::from_utf8_lossy(&out.stdout).lines().map(|l| l.parse().unwrap()).collect();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(theirs.len(), ours.len());
        for ((what, mine), c) in ours.iter().zip(&theirs) {
            assert_eq!(mine, c, "{what}: packd-llama declares {mine}, ggml's headers say {c}");
        }
        // And the version those headers are.
        let cmake = std::fs::read_to_string(root.join("lib/cmake/ggml/ggml-config-version.cmake")).unwrap_or_default();
        assert!(
            cmake.contains(&format!("\"{}\"", super::SUPPORTED_VERSION)),
            "the root's ggml is not {}",
            super::SUPPORTED_VERSION
        );
    }
}
