//! `libpackd_onnxruntime.so`: packd for ONNX Runtime's C and C++ workers.
//!
//! `include/packd_onnxruntime.h` declares the exports (`sys`, this crate's `unsafe`) and, for a
//! program that includes ONNX Runtime's `onnxruntime_c_api.h` first, the helper
//! `packd_ort_create_session`, which creates a session as `OrtApi::CreateSession` does, through
//! packd: the first worker builds the optimized model with its weights and prepacks into
//! memory packd publishes; every other worker's session maps packd's copy.

mod sys;

packd_interpose::c_entry! {
    off: "PACKD_ONNXRUNTIME",
    status_var: "PACKD_ONNXRUNTIME_STATUS",
    // The hooks go in when the first session asks (ONNX Runtime is loaded by then).
    enable: || {},
    json: || packd_interpose::status::to_json(&packd_onnxruntime::status()),
    // Nothing for a process that never asked.
    status: || {
        let status = packd_onnxruntime::status();
        (status.units.sessions > 0).then(|| packd_interpose::status::to_json(&status))
    },
    // Never unloaded: its hooks sit in ONNX Runtime's GOT slots.
    at_load: |enable_fn| {
        if let Some(me) = packd_interpose::identity::library_at(enable_fn) {
            packd_interpose::sys::keep_global(&me);
        }
    },
    at_exit: || {},
    status_fn: packd_onnxruntime_status,
    enable_fn: packd_onnxruntime_enable,
}
