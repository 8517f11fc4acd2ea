/* blink_quant_linear (kernels/cpu/quant_linear.c) on inputs from files, on the kernels' worker
 * pool (pool.c): tests/test_cpu_quant_linear_arm.py builds this for aarch64 and runs it under
 * qemu-user, so that the Arm build, which this machine cannot run, is checked against the
 * builds it runs.
 *
 *   quant_linear_main CASES
 *
 * CASES: a text file, one product a line: "M N K format threads has_bias PREFIX"; reads
 * PREFIX.x (M x K bf16), PREFIX.codes, PREFIX.scales (the packed weight's bytes, read whole) and
 * PREFIX.bias (N bf16, when has_bias), writes PREFIX.y (M x N bf16). Prints "isa N" (what the
 * build reports), then one "ok" or "status S" line a product. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int blink_quant_linear(const uint16_t *x, int64_t x_stride, const void *codes, const void *scales,
                       const uint16_t *bias, uint16_t *y, int64_t y_stride, int64_t M, int64_t N, int64_t K,
                       int format, int threads);
int blink_quant_linear_isa(void);
void blink_use_pool(void *run);
int blink_pool_split(void *(*run)(void *), const void *args, int64_t items, int threads, int64_t parts);

static void *read_file(const char *prefix, const char *suffix) {
    char path[4096];
    snprintf(path, sizeof path, "%s.%s", prefix, suffix);
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    const long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *data = malloc(size > 0 ? (size_t)size : 1);
    if (data && size > 0 && fread(data, 1, (size_t)size, f) != (size_t)size) {
        free(data);
        data = NULL;
    }
    fclose(f);
    return data;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s CASES\n", argv[0]);
        return 2;
    }
    FILE *cases = fopen(argv[1], "r");
    if (!cases) {
        perror(argv[1]);
        return 2;
    }
    blink_use_pool((void *)blink_pool_split);
    printf("isa %d\n", blink_quant_linear_isa());
    long long M, N, K;
    int format, threads, has_bias;
    char prefix[4000];
    while (fscanf(cases, "%lld %lld %lld %d %d %d %3999s", &M, &N, &K, &format, &threads, &has_bias, prefix) == 7) {
        uint16_t *x = read_file(prefix, "x"), *bias = has_bias ? read_file(prefix, "bias") : NULL;
        void *codes = read_file(prefix, "codes"), *scales = read_file(prefix, "scales");
        uint16_t *y = calloc((size_t)(M * N), sizeof *y);
        if (!x || !codes || !scales || !y || (has_bias && !bias)) {
            fprintf(stderr, "%s: an input is missing\n", prefix);
            return 2;
        }
        const int status = blink_quant_linear(x, K, codes, scales, bias, y, N, M, N, K, format, threads);
        if (status == 0) {
            char path[4096];
            snprintf(path, sizeof path, "%s.y", prefix);
            FILE *out = fopen(path, "wb");
            if (!out || fwrite(y, sizeof *y, (size_t)(M * N), out) != (size_t)(M * N) || fclose(out) != 0) {
                perror(path);
                return 2;
            }
            printf("ok\n");
        } else {
            printf("status %d\n", status);
        }
        free(x), free(bias), free(codes), free(scales), free(y);
    }
    fclose(cases);
    return 0;
}
