//! `libpackd_xnnpack_preload.so`: packd as the weights cache of an unmodified engine that
//! exports XNNPACK's C API (ExecuTorch's PyPI wheel, a program linked with libXNNPACK).
//!
//! ```sh
//! LD_PRELOAD=libpackd_xnnpack_preload.so my-worker ...
//! ```
//!
//! Loaded, it turns adoption on (`packd_xnnpack::adopt::enable`): the calls the process's
//! objects make into XNNPACK's runtime creation go through packd. The engine must be loaded
//! with the program (linked to it, as a C++ runner linking ExecuTorch's libraries is); one
//! the program `dlopen`s later is adopted when the program calls `packd_xnnpack_enable()`
//! after loading it. Environment:
//!
//! * `PACKD_XNNPACK=off`: do nothing (the program runs as without the library).
//! * `PACKD_XNNPACK_STATUS=stderr` or `=PATH`: at exit, write what adoption did (one line
//!   of JSON, as `packd_xnnpack_status` returns it) to stderr or append it to PATH.
//! * `PACKD_SOCKET_DIR`: where packd listens (default `/run/packd`).
//!
//! The library exports two C functions for programs that want to ask:
//! `size_t packd_xnnpack_status(char* buf, size_t len)` and `void packd_xnnpack_enable(void)`.

packd_interpose::c_entry! {
    off: "PACKD_XNNPACK",
    status_var: "PACKD_XNNPACK_STATUS",
    enable: || {
        packd_xnnpack::adopt::enable();
    },
    json: || packd_xnnpack::adopt::status().to_json(),
    // Nothing for a process with no XNNPACK (a shell, a helper the worker ran).
    status: || {
        let status = packd_xnnpack::adopt::status();
        (status.ledger.engine.is_some() || status.runtimes > 0).then(|| status.to_json())
    },
    at_load: |_| {},
    at_exit: || {},
    status_fn: packd_xnnpack_status,
    enable_fn: packd_xnnpack_enable,
}
