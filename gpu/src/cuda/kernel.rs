//! The gather/scatter copy kernel: one launch moves a whole fragmented batch, so a load of
//! thousands of small segments costs one driver call instead of one per segment.
//!
//! The kernel is hand-written PTX (the build machine has no CUDA compiler), JIT-compiled by
//! the driver when a device opens. Its input is an array of [`Desc`] in pinned, device-mapped
//! host memory: each thread block takes one descriptor at a time (grid-stride) and copies it
//! with 16-byte accesses, four in flight per thread, reading host memory through its mapped
//! device pointer (H2D) or writing it (D2H).

use std::ffi::{c_void, CStr};

use super::error::CudaError;
use super::ffi;

/// One copy as the kernel reads it (three little-endian u64, 24 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Desc {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

/// Threads per block: eight blocks fill a multiprocessor's 2048 threads.
pub const BLOCK_THREADS: u32 = 256;
/// Resident blocks per multiprocessor the grid is sized for.
pub const BLOCKS_PER_SM: u32 = 8;
/// Largest piece one descriptor carries; longer copies are cut so that every block gets
/// work even when a batch has a few long ranges.
pub const CHUNK_BYTES: u64 = 64 * 1024;

const PTX: &CStr = c"
//
// kvferry_gather: copies a list of (src, dst, len) descriptors, one thread block per
// descriptor at a time (grid-stride over descriptors). Addresses are device-visible:
// device memory, or host memory through its mapped device pointer. Descriptors whose
// addresses and length are all 16-byte aligned move 16 bytes per thread and access, four
// accesses in flight per thread; others fall back to bytes.
//
.version 7.0
.target sm_50
.address_size 64

.visible .entry kvferry_gather(
	.param .u64 kvferry_gather_descs,
	.param .u32 kvferry_gather_count
)
{
	.reg .pred 	%p<8>;
	.reg .b32 	%r<8>;
	.reg .b32 	%v<16>;
	.reg .b64 	%rd<24>;

	ld.param.u64 	%rd1, [kvferry_gather_descs];
	ld.param.u32 	%r1, [kvferry_gather_count];
	mov.u32 	%r2, %ctaid.x;
	mov.u32 	%r3, %nctaid.x;
	mov.u32 	%r4, %tid.x;
	mov.u32 	%r5, %ntid.x;
	mul.wide.u32 	%rd2, %r4, 16;
	mul.wide.u32 	%rd3, %r5, 16;
	mul.wide.u32 	%rd4, %r5, 48;
	mul.wide.u32 	%rd5, %r5, 64;

DESC:
	setp.ge.u32 	%p1, %r2, %r1;
	@%p1 bra 	DONE;
	mul.wide.u32 	%rd6, %r2, 24;
	add.u64 	%rd6, %rd1, %rd6;
	ld.global.u64 	%rd7, [%rd6];
	ld.global.u64 	%rd8, [%rd6+8];
	ld.global.u64 	%rd9, [%rd6+16];
	or.b64 	%rd10, %rd7, %rd8;
	or.b64 	%rd10, %rd10, %rd9;
	and.b64 	%rd10, %rd10, 15;
	setp.ne.u64 	%p2, %rd10, 0;
	@%p2 bra 	BYTES;
	mov.u64 	%rd11, %rd2;

QUAD:
	add.u64 	%rd12, %rd11, %rd4;
	setp.ge.u64 	%p3, %rd12, %rd9;
	@%p3 bra 	ONE;
	add.u64 	%rd13, %rd7, %rd11;
	add.u64 	%rd14, %rd13, %rd3;
	add.u64 	%rd15, %rd14, %rd3;
	add.u64 	%rd16, %rd15, %rd3;
	ld.global.v4.u32 	{%v0, %v1, %v2, %v3}, [%rd13];
	ld.global.v4.u32 	{%v4, %v5, %v6, %v7}, [%rd14];
	ld.global.v4.u32 	{%v8, %v9, %v10, %v11}, [%rd15];
	ld.global.v4.u32 	{%v12, %v13, %v14, %v15}, [%rd16];
	add.u64 	%rd13, %rd8, %rd11;
	add.u64 	%rd14, %rd13, %rd3;
	add.u64 	%rd15, %rd14, %rd3;
	add.u64 	%rd16, %rd15, %rd3;
	st.global.v4.u32 	[%rd13], {%v0, %v1, %v2, %v3};
	st.global.v4.u32 	[%rd14], {%v4, %v5, %v6, %v7};
	st.global.v4.u32 	[%rd15], {%v8, %v9, %v10, %v11};
	st.global.v4.u32 	[%rd16], {%v12, %v13, %v14, %v15};
	add.u64 	%rd11, %rd11, %rd5;
	bra.uni 	QUAD;

ONE:
	setp.ge.u64 	%p4, %rd11, %rd9;
	@%p4 bra 	NEXT;
	add.u64 	%rd13, %rd7, %rd11;
	ld.global.v4.u32 	{%v0, %v1, %v2, %v3}, [%rd13];
	add.u64 	%rd14, %rd8, %rd11;
	st.global.v4.u32 	[%rd14], {%v0, %v1, %v2, %v3};
	add.u64 	%rd11, %rd11, %rd3;
	bra.uni 	ONE;

BYTES:
	cvt.u64.u32 	%rd11, %r4;
	cvt.u64.u32 	%rd17, %r5;

BYTE:
	setp.ge.u64 	%p5, %rd11, %rd9;
	@%p5 bra 	NEXT;
	add.u64 	%rd13, %rd7, %rd11;
	ld.global.u8 	%r6, [%rd13];
	add.u64 	%rd14, %rd8, %rd11;
	st.global.u8 	[%rd14], %r6;
	add.u64 	%rd11, %rd11, %rd17;
	bra.uni 	BYTE;

NEXT:
	add.u32 	%r2, %r2, %r3;
	bra.uni 	DESC;

DONE:
	ret;
}
";

/// The loaded module and its one function, for one context.
pub struct GatherKernel {
    module: ffi::CUmodule,
    function: ffi::CUfunction,
}

// SAFETY: module and function handles are plain driver handles valid from any thread that
// has their context current; the owner (the device) sets its context before every use and
// never unloads the module while a launch may be running.
unsafe impl Send for GatherKernel {}
// SAFETY: launching only reads the handles; the driver serialises its own state.
unsafe impl Sync for GatherKernel {}

impl GatherKernel {
    /// JIT-compiles the kernel into the current context.
    pub fn load() -> Result<Self, CudaError> {
        let module = ffi::module_load_data(PTX)?;
        // SAFETY: `module` was just loaded and is live.
        match unsafe { ffi::module_get_function(module, c"kvferry_gather") } {
            Ok(function) => Ok(Self { module, function }),
            Err(e) => {
                // SAFETY: nothing of the module ran.
                let _ = unsafe { ffi::module_unload(module) };
                Err(e)
            }
        }
    }

    /// Queues one launch over `count` descriptors at `descs` (a device-visible address).
    ///
    /// # Safety
    /// `descs` holds `count` descriptors that, and every range they name, stay valid and
    /// unchanged until the work on `stream` completes; the module's context is current.
    pub unsafe fn launch(
        &self,
        stream: ffi::CUstream,
        descs: u64,
        count: u32,
        sm_count: u32,
    ) -> Result<(), CudaError> {
        if count == 0 {
            return Ok(());
        }
        let grid = count.min(sm_count.max(1) * BLOCKS_PER_SM);
        let mut descs = descs;
        let mut count = count;
        let mut params: [*mut c_void; 2] = [
            (&mut descs as *mut u64).cast(),
            (&mut count as *mut u32).cast(),
        ];
        // SAFETY: the parameters match `(u64 descs, u32 count)`; the caller guarantees the
        // descriptors, the ranges, the stream and the context.
        unsafe { ffi::launch_kernel(self.function, grid, BLOCK_THREADS, stream, &mut params) }
    }

    /// Unloads the module.
    ///
    /// # Safety
    /// No launch is still running; the module's context is current. Called once.
    pub unsafe fn unload(&self) -> Result<(), CudaError> {
        // SAFETY: the caller guarantees no launch runs and that this is the only unload.
        unsafe { ffi::module_unload(self.module) }
    }
}

/// Cuts `(src, dst, len)` into descriptors of at most [`CHUNK_BYTES`].
pub fn push_chunked(out: &mut Vec<Desc>, src: u64, dst: u64, len: u64) {
    let mut off = 0;
    while off < len {
        let n = (len - off).min(CHUNK_BYTES);
        out.push(Desc {
            src: src + off,
            dst: dst + off,
            len: n,
        });
        off += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_range_exactly() {
        let mut v = Vec::new();
        push_chunked(&mut v, 1000, 5000, 2 * CHUNK_BYTES + 16);
        assert_eq!(v.len(), 3);
        assert_eq!(
            v[2],
            Desc {
                src: 1000 + 2 * CHUNK_BYTES,
                dst: 5000 + 2 * CHUNK_BYTES,
                len: 16
            }
        );
        assert_eq!(v.iter().map(|d| d.len).sum::<u64>(), 2 * CHUNK_BYTES + 16);
        assert_eq!(std::mem::size_of::<Desc>(), 24);
    }

    #[test]
    fn ptx_names_the_entry() {
        let s = PTX.to_str().unwrap();
        assert!(s.contains(".visible .entry kvferry_gather("));
    }
}
