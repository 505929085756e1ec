/* Host-only check of the tensor-core fragment index math of
 * kernels/cuda/mma.cuh, runnable without a GPU: ldmatrix (plain and .trans)
 * and mma.sync m16n8k16 are emulated on the host exactly as the PTX ISA
 * defines their fragment layouts, and fed with the very lane addresses
 * (stria__lda_rc, stria__ldb_nrows_rc, stria__ldb_krows_rc), swizzle
 * (stria__swz) and accumulator-to-A mapping (stria__c_to_a_src) the kernels
 * use. The three products of the kernels' patterns are checked against plain
 * matrix products:
 *   S = A B^T    (A rows from a row-major tile, B from a tile whose rows are n)
 *   O = S V      (S in registers as A, V from a tile whose rows are k)
 * for head_dim 64 and 128, several 16-row blocks (row0 = 16 w) and score
 * tiles of 32, 64 and 128 columns. Exit status 0 when everything matches. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda/mma.cuh"

typedef struct {
    float v[2]; /* lo, hi halves of a 32-bit register */
} reg_t;

/* ldmatrix.x4: lane l gives the address of row (l % 8) of matrix l / 8 (8
 * consecutive elements); register i of lane t receives matrix i's elements
 * (t / 4, 2 (t % 4) + {0, 1}), or with .trans (2 (t % 4) + {0, 1}, t / 4). */
static void ldmatrix_x4(const float *const addr[32], bool trans, reg_t out[32][4])
{
    for (int t = 0; t < 32; t++)
        for (int i = 0; i < 4; i++)
            for (int h = 0; h < 2; h++) {
                int r = t / 4, c = 2 * (t % 4) + h;
                if (trans) {
                    r = 2 * (t % 4) + h;
                    c = t / 4;
                }
                out[t][i].v[h] = addr[8 * i + r][c];
            }
}

/* mma.m16n8k16 with fp32 accumulation: g = t / 4, tig = t % 4.
 * A: r0 (g, 2tig+h), r1 (g+8, 2tig+h), r2 (g, 8+2tig+h), r3 (g+8, 8+2tig+h)
 * B: r0 (k 2tig+h, n g), r1 (k 8+2tig+h, n g)
 * C: c[h] (g, 2tig+h), c[2+h] (g+8, 2tig+h) */
static void mma(float c[32][4], const reg_t a[32][4], const reg_t b[32][2])
{
    float A[16][16], B[16][8];
    for (int t = 0; t < 32; t++) {
        int g = t / 4, q = t % 4;
        for (int h = 0; h < 2; h++) {
            A[g][2 * q + h] = a[t][0].v[h];
            A[g + 8][2 * q + h] = a[t][1].v[h];
            A[g][8 + 2 * q + h] = a[t][2].v[h];
            A[g + 8][8 + 2 * q + h] = a[t][3].v[h];
            B[2 * q + h][g] = b[t][0].v[h];
            B[8 + 2 * q + h][g] = b[t][1].v[h];
        }
    }
    for (int t = 0; t < 32; t++) {
        int g = t / 4, q = t % 4;
        for (int h = 0; h < 4; h++) {
            int row = g + (h >= 2 ? 8 : 0), col = 2 * q + (h & 1);
            double acc = c[t][h];
            for (int k = 0; k < 16; k++)
                acc += (double)A[row][k] * B[k][col];
            c[t][h] = (float)acc;
        }
    }
}

static float frand(unsigned *s)
{
    *s = *s * 1664525u + 1013904223u;
    return (float)((*s >> 8) & 0xffff) / 65536.0f - 0.5f;
}

static int failures = 0;

static void expect_close(const char *what, int D, int N, int row0, int i, int j, double got,
                         double want)
{
    if (fabs(got - want) > 1e-4 * (1.0 + fabs(want))) {
        if (failures < 20)
            fprintf(stderr, "%s D=%d N=%d row0=%d: [%d][%d] = %g, want %g\n", what, D, N, row0, i,
                    j, got, want);
        failures++;
    }
}

/* One warp: rows [row0, row0 + 16) of a swizzled R x D tile A, an N x D tile B
 * (rows n) and an N x D tile V (rows k). */
template <int D> static void check(int N, int row0)
{
    const int R = row0 + 16;
    float *A = (float *)calloc((size_t)(R * D), sizeof(float));
    float *Bt = (float *)calloc((size_t)(N * D), sizeof(float));
    float *Vt = (float *)calloc((size_t)(N * D), sizeof(float));
    float *a = (float *)malloc((size_t)(R * D) * sizeof(float));
    float *b = (float *)malloc((size_t)(N * D) * sizeof(float));
    float *v = (float *)malloc((size_t)(N * D) * sizeof(float));
    float(*s)[32][4] = (float(*)[32][4])calloc((size_t)(N / 8), sizeof(*s));
    float(*o)[32][4] = (float(*)[32][4])calloc((size_t)(D / 8), sizeof(*o));
    unsigned seed = 12345u + (unsigned)(D * 7 + N * 3 + row0);

    for (int i = 0; i < R * D; i++)
        a[i] = frand(&seed);
    for (int i = 0; i < N * D; i++) {
        b[i] = frand(&seed);
        v[i] = frand(&seed);
    }
    /* the swizzle is a permutation of each row; store the tiles through it */
    for (int r = 0; r < R; r++) {
        bool seen[256] = {false};
        for (int c = 0; c < D; c++) {
            int off = stria__swz<D>(r, c) - r * D;
            if (off < 0 || off >= D || seen[off]) {
                fprintf(stderr, "swizzle D=%d: row %d col %d maps to %d\n", D, r, c, off);
                failures++;
                continue;
            }
            seen[off] = true;
            A[stria__swz<D>(r, c)] = a[r * D + c];
        }
    }
    for (int r = 0; r < N; r++)
        for (int c = 0; c < D; c++) {
            Bt[stria__swz<D>(r, c)] = b[r * D + c];
            Vt[stria__swz<D>(r, c)] = v[r * D + c];
        }

    /* S = A B^T: the loops of stria__gemm2_nrows and the forward's S */
    for (int kk = 0; kk < D / 16; kk++) {
        const float *addr[32];
        reg_t af[32][4], bf[32][4];
        for (int l = 0; l < 32; l++) {
            stria__rc rc = stria__lda_rc(row0, kk, l);
            addr[l] = A + stria__swz<D>(rc.row, rc.col);
        }
        ldmatrix_x4(addr, false, af);
        for (int p = 0; p < N / 16; p++) {
            reg_t b0[32][2], b1[32][2];
            for (int l = 0; l < 32; l++) {
                stria__rc rc = stria__ldb_nrows_rc(p * 16, kk, l);
                addr[l] = Bt + stria__swz<D>(rc.row, rc.col);
            }
            ldmatrix_x4(addr, false, bf);
            for (int t = 0; t < 32; t++) {
                b0[t][0] = bf[t][0], b0[t][1] = bf[t][1];
                b1[t][0] = bf[t][2], b1[t][1] = bf[t][3];
            }
            mma(s[2 * p], af, b0);
            mma(s[2 * p + 1], af, b1);
        }
    }
    for (int nb = 0; nb < N / 8; nb++)
        for (int t = 0; t < 32; t++)
            for (int h = 0; h < 4; h++) {
                int i = t / 4 + (h >= 2 ? 8 : 0), j = nb * 8 + 2 * (t % 4) + (h & 1);
                double want = 0.0;
                for (int d = 0; d < D; d++)
                    want += (double)a[(row0 + i) * D + d] * b[j * D + d];
                expect_close("S = A B^T", D, N, row0, i, j, s[nb][t][h], want);
            }

    /* O = S V: the loops of stria__gemm_c_krows with stria__c_to_a_src */
    for (int kk = 0; kk < N / 16; kk++) {
        reg_t pa[32][4], bf[32][4];
        const float *addr[32];
        for (int t = 0; t < 32; t++)
            for (int r = 0; r < 4; r++) {
                stria__rc src = stria__c_to_a_src(kk, r);
                pa[t][r].v[0] = s[src.row][t][src.col];
                pa[t][r].v[1] = s[src.row][t][src.col + 1];
            }
        for (int p = 0; p < D / 16; p++) {
            reg_t b0[32][2], b1[32][2];
            for (int l = 0; l < 32; l++) {
                stria__rc rc = stria__ldb_krows_rc(kk * 16, p * 16, l);
                addr[l] = Vt + stria__swz<D>(rc.row, rc.col);
            }
            ldmatrix_x4(addr, true, bf);
            for (int t = 0; t < 32; t++) {
                b0[t][0] = bf[t][0], b0[t][1] = bf[t][1];
                b1[t][0] = bf[t][2], b1[t][1] = bf[t][3];
            }
            mma(o[2 * p], pa, b0);
            mma(o[2 * p + 1], pa, b1);
        }
    }
    for (int nb = 0; nb < D / 8; nb++)
        for (int t = 0; t < 32; t++)
            for (int h = 0; h < 4; h++) {
                int i = t / 4 + (h >= 2 ? 8 : 0), j = nb * 8 + 2 * (t % 4) + (h & 1);
                double want = 0.0;
                for (int k = 0; k < N; k++) {
                    double sik = 0.0;
                    for (int d = 0; d < D; d++)
                        sik += (double)a[(row0 + i) * D + d] * b[k * D + d];
                    want += (double)(float)sik * v[k * D + j];
                }
                expect_close("O = S V", D, N, row0, i, j, o[nb][t][h], want);
            }
    free(A), free(Bt), free(Vt), free(a), free(b), free(v), free(s), free(o);
}

int main(void)
{
    static const int ns[] = {32, 64, 128};
    for (int w = 0; w < 8; w++)
        for (int n = 0; n < 3; n++) {
            check<64>(ns[n], 16 * w);
            check<128>(ns[n], 16 * w);
        }
    if (failures != 0) {
        fprintf(stderr, "test_mma_layout: %d mismatches\n", failures);
        return 1;
    }
    printf("test_mma_layout: fragment layouts of mma.cuh match plain products "
           "(head_dim 64, 128; 16-row blocks 0..7; tiles of 32, 64, 128)\n");
    return 0;
}
