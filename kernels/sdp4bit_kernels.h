// The kernel table: one line SDP_KERNEL(name, body, parameter struct, widest load, widest
// store, pointer parameters) per kernel family of the launch ABI (sdp4bit_abi.h), in the order
// of the Rust `Kernel` enum. `body` is the template in a .cu file that the family's entry points
// instantiate with a spec (spec.cuh): src/backend/cuda/spec.rs writes, per configuration a job
// uses, one `extern "C" __global__ void <name>__<configuration>(pointer parameters, struct
// args)` calling `body<spec>(pointers..., args)` (the template deduces the element types from
// the pointers). The widths are those in bits of the kernel's widest global load and store (0:
// none), the accesses its streaming data is planned to move in (fp32 runs and eight bf16 in
// 16-byte accesses, four bf16 in 8-byte ones, codes in 32-bit words). Every other list of
// kernels is made from it or checked against it:
// - build.rs generates the Rust `Kernel` enum (names, bodies, pointer parameters, parameter
//   struct, access widths, and the .cu file defining the body) and the list of sources from it,
//   and fails unless each body is defined by exactly one .cu file and every template a .cu file
//   defines at top level with a `_of` name is listed here;
// - tests/cuda_compile.rs checks each specialisation's SASS against its widths and its
//   registers against the budget its launch bounds leave;
// - the host emulators (tests/kernel_emulator, tests/cuda_driver_emulation) run the wrappers the
//   Rust side writes, compiled by g++, and read from their prototypes which pointers a kernel
//   writes (those whose pointee is not const).
// Every kernel takes its device pointers, then its parameter struct by value. A name ending in
// _bf16 is the variant of a gradient kernel that reads or writes sdp_bf16 elements.
//
// No include guard: included once per use, with SDP_KERNEL defined. One line per kernel, its
// comment on the lines above.

// Hadamard + quantize + swizzle of a gradient bucket.
SDP_KERNEL(grad_quantize_first, grad_quantize_first_of, sdp_grad_first, 128, 32, const float* bucket, const uint32_t* dests, uint8_t* out)
// Dequantize + sum + requantize between the two gradient levels.
SDP_KERNEL(grad_requantize_second, grad_requantize_second_of, sdp_grad_second, 32, 32, const uint8_t* recv, const uint32_t* dests, uint8_t* out)
// Dequantize + sum + inverse Hadamard into the shard.
SDP_KERNEL(grad_reduce_final, grad_reduce_final_of, sdp_grad_final, 32, 128, const uint8_t* recv, float* shard)
// Quantize a weight shard or its difference.
SDP_KERNEL(weight_encode, weight_encode_of, sdp_weight_encode, 128, 64, const uint16_t* new_shard, const uint16_t* reference, uint8_t* out)
// Apply every rank's weight slab to the param bucket.
SDP_KERNEL(weight_apply, weight_apply_of, sdp_weight_apply, 128, 128, const uint8_t* recv, const uint16_t* own_reference, uint16_t* params)
// Global-QSGD: absmax bits of a bucket.
SDP_KERNEL(global_absmax, global_absmax_of, sdp_global, 128, 0, const float* bucket, uint32_t* abs_bits)
// Global-QSGD: round to int8.
SDP_KERNEL(global_quantize_i8, global_quantize_of, sdp_global, 128, 32, const float* bucket, int8_t* out)
// Global-QSGD: round to int16.
SDP_KERNEL(global_quantize_i16, global_quantize_of, sdp_global, 128, 64, const float* bucket, int16_t* out)
// Global-QSGD: dequantize summed int8.
SDP_KERNEL(global_dequantize_i8, global_dequantize_of, sdp_global, 32, 128, const int8_t* sum, float* out)
// Global-QSGD: dequantize summed int16.
SDP_KERNEL(global_dequantize_i16, global_dequantize_of, sdp_global, 64, 128, const int16_t* sum, float* out)
// grad_quantize_first of a bf16 bucket.
SDP_KERNEL(grad_quantize_first_bf16, grad_quantize_first_of, sdp_grad_first, 64, 32, const sdp_bf16* bucket, const uint32_t* dests, uint8_t* out)
// grad_reduce_final into a bf16 shard.
SDP_KERNEL(grad_reduce_final_bf16, grad_reduce_final_of, sdp_grad_final, 32, 64, const uint8_t* recv, sdp_bf16* shard)
// global_absmax of a bf16 bucket.
SDP_KERNEL(global_absmax_bf16, global_absmax_of, sdp_global, 64, 0, const sdp_bf16* bucket, uint32_t* abs_bits)
// global_quantize_i8 of a bf16 bucket.
SDP_KERNEL(global_quantize_i8_bf16, global_quantize_of, sdp_global, 64, 32, const sdp_bf16* bucket, int8_t* out)
// global_quantize_i16 of a bf16 bucket.
SDP_KERNEL(global_quantize_i16_bf16, global_quantize_of, sdp_global, 64, 64, const sdp_bf16* bucket, int16_t* out)
// global_dequantize_i8 into a bf16 shard.
SDP_KERNEL(global_dequantize_i8_bf16, global_dequantize_of, sdp_global, 32, 64, const int8_t* sum, sdp_bf16* out)
// global_dequantize_i16 into a bf16 shard.
SDP_KERNEL(global_dequantize_i16_bf16, global_dequantize_of, sdp_global, 64, 64, const int16_t* sum, sdp_bf16* out)
// bf16 gradients to fp32.
SDP_KERNEL(grad_widen_bf16, grad_convert_of, sdp_convert, 64, 128, const sdp_bf16* src, float* dst)
// fp32 gradients rounded to bf16.
SDP_KERNEL(grad_narrow_bf16, grad_convert_of, sdp_convert, 128, 64, const float* src, sdp_bf16* dst)
// bf16 gradients through fp32 back to bf16.
SDP_KERNEL(grad_round_bf16, grad_convert_of, sdp_convert, 64, 64, const sdp_bf16* src, sdp_bf16* dst)
