//! The project's own CUDA kernels (sources in kernels/), compiled to PTX by build.rs and
//! loaded into a device's context on first use.

/// PTX text of each kernels/*.cu file, named after the file.
pub mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}
