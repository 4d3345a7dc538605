//! The parts of ggml's structures the integration reads or writes, declared for the ggml
//! versions it supports ([`SUPPORTED`]: the llama.cpp copies PyPI's llama-cpp-python
//! 0.3.19, 0.3.30 and 0.3.36 vendor). `struct ggml_tensor` is public (`ggml.h`) and the same
//! in all of them; `struct ggml_backend_buffer` and its function table are ggml's private
//! interface (`ggml-backend-impl.h`) and changed between them (the 2-D copies came between
//! ggml 0.9.11 and 0.13.1), so each version names its [`Layout`], and nothing here is used unless the
//! running library's `ggml_version()` is in the table. `tests/tests/llama.rs` and the test
//! below compile the offsets against each version's own headers and compare.

#![forbid(unsafe_code)]

use std::ffi::{c_char, c_void};

/// A ggml version the integration supports, and where it comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Supported {
    /// `ggml_version()`.
    pub ggml: &'static str,
    /// The llama.cpp commit that release vendors.
    pub llama_cpp: &'static str,
    /// The llama-cpp-python release whose sdist vendors it.
    pub release: &'static str,
    /// How its backend buffer is laid out.
    pub layout: Layout,
}

/// How `struct ggml_backend_buffer` is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// ggml 0.9: the function table without the 2-D copies ([`BufferIface09`]).
    Ggml09,
    /// ggml 0.13 and later: with `set_tensor_2d` and `get_tensor_2d` ([`BufferIface`]).
    Ggml013,
}

/// The versions the integration supports, oldest first. A library of any other version
/// runs as without packd, and says why.
pub const SUPPORTED: &[Supported] = &[
    Supported { ggml: "0.9.8", llama_cpp: "c0159f9", release: "0.3.19", layout: Layout::Ggml09 },
    Supported { ggml: "0.15.1", llama_cpp: "e3a74b2", release: "0.3.30", layout: Layout::Ggml013 },
    Supported { ggml: "0.25.3", llama_cpp: "0c1e570", release: "0.3.36", layout: Layout::Ggml013 },
];

/// The table's entry for `ggml_version`, if any.
pub fn supported(ggml_version: &str) -> Option<&'static Supported> {
    SUPPORTED.iter().find(|s| s.ggml == ggml_version)
}

/// The supported versions, for messages: "ggml 0.9.8, 0.15.1 and 0.25.3 (llama.cpp …)".
pub fn supported_list() -> String {
    let ggml: Vec<&str> = SUPPORTED.iter().map(|s| s.ggml).collect();
    let from: Vec<String> =
        SUPPORTED.iter().map(|s| format!("{} in llama-cpp-python {}", s.llama_cpp, s.release)).collect();
    let (last, rest) = ggml.split_last().expect("a supported version");
    format!("ggml {} and {last} (llama.cpp {})", rest.join(", "), from.join(", "))
}

/// `GGML_MAX_DIMS`.
pub const MAX_DIMS: usize = 4;
/// `GGML_MAX_NAME`.
pub const MAX_NAME: usize = 64;
/// `GGML_MAX_SRC`.
const MAX_SRC: usize = 10;
/// `GGML_MAX_OP_PARAMS` / 4.
const OP_PARAMS: usize = 16;

/// A buffer handle (`ggml_backend_buffer_t`): a [`Buffer`] of the running version's
/// [`Layout`].
pub type BufferPtr = *mut c_void;
/// A buffer type handle (`ggml_backend_buffer_type_t`), never looked into.
pub type BufferTypePtr = *mut c_void;
/// A tensor handle.
pub type TensorPtr = *mut Tensor;

/// `ggml_nbytes`.
pub type NbytesFn = unsafe extern "C" fn(*const Tensor) -> usize;
/// `ggml_type_name`.
pub type TypeNameFn = unsafe extern "C" fn(i32) -> *const c_char;
/// `ggml_backend_buft_get_device`.
pub type BuftDeviceFn = unsafe extern "C" fn(BufferTypePtr) -> *mut c_void;
/// `ggml_backend_dev_backend_reg`.
pub type DevRegFn = unsafe extern "C" fn(*mut c_void) -> *mut c_void;
/// `ggml_backend_reg_get_proc_address`.
pub type ProcAddressFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// `free_buffer`.
pub type FreeFn = unsafe extern "C" fn(BufferPtr);
/// `get_base`.
pub type GetBaseFn = unsafe extern "C" fn(BufferPtr) -> *mut c_void;
/// `init_tensor`.
pub type InitFn = unsafe extern "C" fn(BufferPtr, TensorPtr) -> i32;
/// `memset_tensor`.
pub type MemsetFn = unsafe extern "C" fn(BufferPtr, TensorPtr, u8, usize, usize);
/// `set_tensor`.
pub type SetFn = unsafe extern "C" fn(BufferPtr, TensorPtr, *const c_void, usize, usize);
/// `get_tensor`.
pub type GetFn = unsafe extern "C" fn(BufferPtr, *const Tensor, *mut c_void, usize, usize);
/// `cpy_tensor`.
pub type CpyFn = unsafe extern "C" fn(BufferPtr, *const Tensor, TensorPtr) -> bool;
/// `clear`.
pub type ClearFn = unsafe extern "C" fn(BufferPtr, u8);
/// `reset`.
pub type ResetFn = unsafe extern "C" fn(BufferPtr);

/// The entries of a buffer's function table the integration reads or replaces, whatever
/// the layout.
#[derive(Clone, Copy, Default)]
pub struct Fns {
    pub free_buffer: Option<FreeFn>,
    pub get_base: Option<GetBaseFn>,
    pub init_tensor: Option<InitFn>,
    pub memset_tensor: Option<MemsetFn>,
    pub set_tensor: Option<SetFn>,
    pub clear: Option<ClearFn>,
}

/// A function table of one layout.
pub trait Iface: Copy {
    /// Its entries the integration uses.
    fn fns(&self) -> Fns;
    /// Replaces those entries.
    fn set_fns(&mut self, f: &Fns);
    /// The offsets of the entries the integration uses or that differ between layouts.
    fn offsets() -> Vec<(&'static str, usize)>;
    /// Whether the table has a 2-D copy (`set_tensor_2d`, `get_tensor_2d`), which packd does
    /// not take over (the CPU buffers of the supported versions have none).
    fn other_writer(&self) -> bool;
}

/// Declares one layout's `struct ggml_backend_buffer_i`: the entries every layout has, in
/// ggml's order, with the layout's own (`$two_d`, the 2-D copies) after `get_tensor`; and
/// its [`Iface`].
macro_rules! buffer_iface {
    ($(#[$doc:meta])* $name:ident { $($two_d:ident),* }) => {
        $(#[$doc])*
        #[repr(C)]
        #[derive(Clone, Copy)]
        pub struct $name {
            pub free_buffer: Option<FreeFn>,
            pub get_base: Option<GetBaseFn>,
            pub init_tensor: Option<InitFn>,
            pub memset_tensor: Option<MemsetFn>,
            pub set_tensor: Option<SetFn>,
            pub get_tensor: Option<GetFn>,
            $(pub $two_d: Option<unsafe extern "C" fn()>,)*
            pub cpy_tensor: Option<CpyFn>,
            pub clear: Option<ClearFn>,
            pub reset: Option<ResetFn>,
        }

        impl Iface for $name {
            fn fns(&self) -> Fns {
                Fns {
                    free_buffer: self.free_buffer,
                    get_base: self.get_base,
                    init_tensor: self.init_tensor,
                    memset_tensor: self.memset_tensor,
                    set_tensor: self.set_tensor,
                    clear: self.clear,
                }
            }
            fn set_fns(&mut self, f: &Fns) {
                self.free_buffer = f.free_buffer;
                self.get_base = f.get_base;
                self.init_tensor = f.init_tensor;
                self.memset_tensor = f.memset_tensor;
                self.set_tensor = f.set_tensor;
                self.clear = f.clear;
            }
            fn other_writer(&self) -> bool {
                false $(|| self.$two_d.is_some())*
            }
            fn offsets() -> Vec<(&'static str, usize)> {
                use std::mem::offset_of;
                vec![
                    ("offsetof(ggml_backend_buffer_i, init_tensor)", offset_of!($name, init_tensor)),
                    ("offsetof(ggml_backend_buffer_i, memset_tensor)", offset_of!($name, memset_tensor)),
                    ("offsetof(ggml_backend_buffer_i, set_tensor)", offset_of!($name, set_tensor)),
                    ("offsetof(ggml_backend_buffer_i, cpy_tensor)", offset_of!($name, cpy_tensor)),
                    ("offsetof(ggml_backend_buffer_i, clear)", offset_of!($name, clear)),
                    ("offsetof(ggml_backend_buffer_i, reset)", offset_of!($name, reset)),
                ]
            }
        }
    };
}

buffer_iface!(
    /// `struct ggml_backend_buffer_i` of ggml 0.13 and later (ggml-backend-impl.h).
    BufferIface { set_tensor_2d, get_tensor_2d }
);
buffer_iface!(
    /// `struct ggml_backend_buffer_i` of ggml 0.9 (ggml-backend-impl.h): no 2-D copies.
    BufferIface09 {}
);

/// `struct ggml_backend_buffer` (ggml-backend-impl.h), with the function table `I` of its
/// layout.
#[repr(C)]
pub struct Buffer<I> {
    pub iface: I,
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

impl Layout {
    /// The facts the layout tests check against a version's headers: `(what, value)`
    /// pairs, printed by the test's C program in the same order.
    pub fn facts(self) -> Vec<(&'static str, usize)> {
        match self {
            Layout::Ggml09 => facts::<BufferIface09>(None),
            Layout::Ggml013 => facts::<BufferIface>(Some(std::mem::offset_of!(BufferIface, set_tensor_2d))),
        }
    }

    /// A digest of [`Layout::facts`] (16 hex digits), as docs/INTEGRATION.md lists it.
    pub fn digest(self) -> String {
        let mut h = blake3::Hasher::new();
        for (what, v) in self.facts() {
            h.update(format!("{what}={v}\n").as_bytes());
        }
        h.finalize().to_hex()[..16].to_string()
    }
}

fn facts<I: Iface>(set_tensor_2d: Option<usize>) -> Vec<(&'static str, usize)> {
    use std::mem::{offset_of, size_of};
    let mut v = vec![("sizeof(struct ggml_backend_buffer_i)", size_of::<I>())];
    v.extend(I::offsets());
    if let Some(at) = set_tensor_2d {
        v.push(("offsetof(ggml_backend_buffer_i, set_tensor_2d)", at));
    }
    v.extend([
        ("sizeof(struct ggml_backend_buffer)", size_of::<Buffer<I>>()),
        ("offsetof(ggml_backend_buffer, buft)", offset_of!(Buffer<I>, buft)),
        ("offsetof(ggml_backend_buffer, context)", offset_of!(Buffer<I>, context)),
        ("offsetof(ggml_backend_buffer, size)", offset_of!(Buffer<I>, size)),
        ("offsetof(ggml_backend_buffer, usage)", offset_of!(Buffer<I>, usage)),
        ("sizeof(struct ggml_tensor)", size_of::<Tensor>()),
        ("offsetof(ggml_tensor, buffer)", offset_of!(Tensor, buffer)),
        ("offsetof(ggml_tensor, ne)", offset_of!(Tensor, ne)),
        ("offsetof(ggml_tensor, nb)", offset_of!(Tensor, nb)),
        ("offsetof(ggml_tensor, view_src)", offset_of!(Tensor, view_src)),
        ("offsetof(ggml_tensor, data)", offset_of!(Tensor, data)),
        ("offsetof(ggml_tensor, name)", offset_of!(Tensor, name)),
        ("offsetof(ggml_tensor, extra)", offset_of!(Tensor, extra)),
    ]);
    v
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};
    use std::process::Command;

    use super::{Layout, SUPPORTED, supported};

    fn root() -> PathBuf {
        std::env::var_os("LLAMA_ROOT")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/cache/llama/0.3.36/root"))
    }

    /// Compiles `program` against the root's headers and libggml-base, runs it and returns
    /// its output lines.
    fn c_lines(root: &Path, name: &str, program: &str) -> Vec<String> {
        let dir = std::env::temp_dir().join(format!("packd-llama-layout-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("p.c"), program).unwrap();
        let lib = root.join("lib");
        let built = Command::new("cc")
            .arg(dir.join("p.c"))
            .arg("-I")
            .arg(root.join("include"))
            .arg("-I")
            .arg(root.join("include/ggml-private"))
            .arg("-L")
            .arg(&lib)
            .arg(format!("-Wl,-rpath,{}", lib.display()))
            .args(["-lggml-base", "-o"])
            .arg(dir.join("p"))
            .output()
            .expect("run cc");
        assert!(built.status.success(), "cc: {}", String::from_utf8_lossy(&built.stderr));
        let out = Command::new(dir.join("p")).output().expect("run the C program");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect()
    }

    /// The root's ggml says which version it is; its headers, compiled by the C compiler,
    /// have the offsets and sizes the table's layout for that version declares.
    #[test]
    #[cfg_attr(
        not(packd_llama),
        ignore = "needs a llama.cpp root with ggml's private headers: run .ci/run, or set LLAMA_ROOT \
                  (examples/llama/fetch-llama)"
    )]
    fn the_declared_layout_is_the_headers_layout_of_the_roots_version() {
        let root = root();
        let version = c_lines(
            &root,
            "version",
            "#include <stdio.h>\n#include \"ggml.h\"\nint main(void) { puts(ggml_version()); return 0; }\n",
        );
        let version = version.first().expect("ggml_version()");
        let Some(entry) = supported(version) else {
            panic!("{} is ggml {version}, which is not in the table {SUPPORTED:?}", root.display());
        };
        let ours = entry.layout.facts();
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
        let theirs: Vec<usize> = c_lines(&root, "facts", &c).iter().map(|l| l.parse().unwrap()).collect();
        assert_eq!(theirs.len(), ours.len());
        for ((what, mine), c) in ours.iter().zip(&theirs) {
            assert_eq!(mine, c, "ggml {version}: {what}: packd-llama declares {mine}, ggml's headers say {c}");
        }
        eprintln!("ggml {version}: layout {:?}, digest {}", entry.layout, entry.layout.digest());
    }

    #[test]
    fn the_layouts_differ_only_by_the_two_copies() {
        let (old, new) = (Layout::Ggml09.facts(), Layout::Ggml013.facts());
        let get = |f: &[(&str, usize)], k: &str| f.iter().find(|(w, _)| *w == k).map(|p| p.1);
        assert_eq!(
            get(&new, "sizeof(struct ggml_backend_buffer_i)"),
            get(&old, "sizeof(struct ggml_backend_buffer_i)").map(|s| s + 16)
        );
        assert_eq!(
            get(&new, "offsetof(ggml_backend_buffer_i, set_tensor)"),
            get(&old, "offsetof(ggml_backend_buffer_i, set_tensor)")
        );
        assert_eq!(
            get(&new, "offsetof(ggml_backend_buffer_i, clear)"),
            get(&old, "offsetof(ggml_backend_buffer_i, clear)").map(|s| s + 16)
        );
        // As docs/INTEGRATION.md's table lists them (64-bit targets).
        assert_eq!(Layout::Ggml09.digest(), "b3aa31c1f125b028");
        assert_eq!(Layout::Ggml013.digest(), "33cc7dbf1c9c0ce2");
        assert_eq!(supported("0.25.3").map(|s| s.layout), Some(Layout::Ggml013));
        assert_eq!(supported("0.9.8").map(|s| s.layout), Some(Layout::Ggml09));
        assert!(supported("0.25.4").is_none() && supported("0.9.11").is_none());
        assert_eq!(
            super::supported_list(),
            "ggml 0.9.8, 0.15.1 and 0.25.3 (llama.cpp c0159f9 in llama-cpp-python 0.3.19, e3a74b2 in \
             llama-cpp-python 0.3.30, 0c1e570 in llama-cpp-python 0.3.36)"
        );
    }
}
