// The kernels' division helpers (kernels/common.cuh) as plain C functions over arrays, built
// by tests/cuda_emulated/divide.rs into a shared library (with cuda_shim.h force-included, as
// the emulator builds the kernels) and compared there with Rust's `/`.
#include "common.cuh"

#include <cstddef>

extern "C" {

// q[i] = x[i] / s[i] through sdp_divide_run with the divisor sdp_divisor_of(s[i], bound[i]), on
// a run of four copies of x[i] (the caller keeps |x[i]| <= bound[i], or bound[i] NaN or Inf).
void sdp_test_divide(const float* x, const float* s, const float* bound, float* q, size_t n)
{
    for (size_t i = 0; i < n; ++i) {
        const float run[4] = {x[i], x[i], x[i], x[i]};
        float quotients[4];
        sdp_divide_run<4>(sdp_divisor_of(s[i], bound[i]), run, quotients);
        q[i] = quotients[0];
    }
}

// q[i] = x[i] / s for one divisor, through the run helper of 4 quotients (n a multiple of 4).
void sdp_test_divide_runs(const float* x, float s, float bound, float* q, size_t n)
{
    const sdp_divisor d = sdp_divisor_of(s, bound);
    for (size_t i = 0; i + 4 <= n; i += 4) {
        sdp_divide_run<4>(d, x + i, q + i);
    }
}
}
