/* Declarations of the part of XNNPACK's C API that packd's XNNPACK examples use, for the
 * XNNPACK that engines ship today: upstream commit 92a7ad5 (2026-07), whose C API
 * ExecuTorch 1.5.1's PyPI wheel exports from libexecutorch_backend_xnnpack.so. The wheel
 * ships no xnnpack.h; examples/xnnpack/fetch-xnnpack-current puts this file beside its
 * libraries. Written for packd from the published interface (types, values and signatures
 * as XNNPACK defines them at that commit); it declares a subset, not the whole API.
 *
 * The weights-cache interface here is the current one: the look-up key has
 * `fingerprint_id` (since 2025-11) and the provider has `alias_data` (since 2026-03). */
#ifndef XNNPACK_H_
#define XNNPACK_H_

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes XNNPACK may read (never write) past the end of tensor data (x86, Arm). */
#define XNN_EXTRA_BYTES 16
#define XNN_INVALID_VALUE_ID UINT32_MAX

#define XNN_FLAG_FORCE_FP16_INFERENCE 0x00000004
#define XNN_VALUE_FLAG_EXTERNAL_INPUT 0x00000001
#define XNN_VALUE_FLAG_EXTERNAL_OUTPUT 0x00000002

enum xnn_status {
  xnn_status_success = 0,
  xnn_status_uninitialized = 1,
  xnn_status_invalid_parameter = 2,
  xnn_status_invalid_state = 3,
  xnn_status_unsupported_parameter = 4,
  xnn_status_unsupported_hardware = 5,
  xnn_status_out_of_memory = 6,
  xnn_status_reallocation_required = 7,
  xnn_status_deprecated = 8,
};

enum xnn_datatype {
  xnn_datatype_invalid = 0,
  xnn_datatype_fp32 = 1,
  xnn_datatype_fp16 = 2,
  xnn_datatype_qint8 = 3,
  xnn_datatype_quint8 = 4,
  xnn_datatype_qint32 = 5,
  xnn_datatype_qcint8 = 6,
  xnn_datatype_qcint32 = 7,
  xnn_datatype_qcint4 = 8,
  xnn_datatype_qdint8 = 9,
  xnn_datatype_qpint8 = 10,
  xnn_datatype_int32 = 11,
  xnn_datatype_qbint4 = 12,
  xnn_datatype_pfp32 = 13,
  xnn_datatype_bf16 = 14,
  xnn_datatype_qduint8 = 15,
  xnn_datatype_pfp16 = 16,
  xnn_datatype_pqint8 = 17,
  xnn_datatype_qcint2 = 18,
  xnn_datatype_qint4 = 19,
  xnn_datatype_qint2 = 20,
};

/* Only the operators the examples use are named; the values are XNNPACK's. */
enum xnn_unary_operator {
  xnn_unary_invalid = -1,
  xnn_unary_convert = 5,
};

enum xnn_binary_operator {
  xnn_binary_invalid = -1,
  xnn_binary_prelu = 8,
};

union xnn_unary_params;

struct xnn_binary_params {
  double output_min;
  double output_max;
};

struct xnn_allocator;
typedef struct xnn_subgraph* xnn_subgraph_t;
typedef struct xnn_runtime* xnn_runtime_t;
typedef struct xnn_workspace* xnn_workspace_t;
typedef struct pthreadpool* pthreadpool_t;

struct xnn_external_value {
  uint32_t id;
  void* data;
};

enum xnn_weights_cache_finalization_kind {
  xnn_weights_cache_finalization_kind_hard,
  xnn_weights_cache_finalization_kind_soft,
};

struct xnn_weights_cache_look_up_key {
  uint32_t seed;
  const void* kernel;
  const void* bias;
  uint32_t fingerprint_id;
};

struct xnn_weights_cache_provider {
  void* context;
  size_t (*look_up)(void* context, const struct xnn_weights_cache_look_up_key* cache_key);
  void* (*reserve_space)(void* context, size_t n);
  size_t (*look_up_or_insert)(void* context, const struct xnn_weights_cache_look_up_key* cache_key, void* ptr,
                              size_t size);
  bool (*is_finalized)(void* context);
  void* (*offset_to_addr)(void* context, size_t offset);
  enum xnn_status (*delete_cache)(void* context);
  enum xnn_status (*alias_data)(void* context, void* alias, void* original);
};

typedef struct xnn_weights_cache_provider* xnn_weights_cache_t;

enum xnn_status xnn_initialize(const struct xnn_allocator* allocator);

const void* xnn_experimental_get_build_identifier_data(void);
size_t xnn_experimental_get_build_identifier_size(void);

enum xnn_status xnn_create_subgraph(uint32_t external_value_ids, uint32_t flags, xnn_subgraph_t* subgraph_out);
enum xnn_status xnn_delete_subgraph(xnn_subgraph_t subgraph);

enum xnn_status xnn_define_tensor_value(xnn_subgraph_t subgraph, enum xnn_datatype datatype, size_t num_dims,
                                        const size_t* dims, const void* data, uint32_t external_id, uint32_t flags,
                                        uint32_t* id_out);
enum xnn_status xnn_define_quantized_tensor_value(xnn_subgraph_t subgraph, enum xnn_datatype datatype,
                                                  int32_t zero_point, float scale, size_t num_dims,
                                                  const size_t* dims, const void* data, uint32_t external_id,
                                                  uint32_t flags, uint32_t* id_out);
enum xnn_status xnn_define_channelwise_quantized_tensor_value(xnn_subgraph_t subgraph, enum xnn_datatype datatype,
                                                              const float* scale, size_t num_dims, size_t channel_dim,
                                                              const size_t* dims, const void* data,
                                                              uint32_t external_id, uint32_t flags, uint32_t* id_out);
enum xnn_status xnn_define_channelwise_quantized_tensor_value_v2(xnn_subgraph_t subgraph, enum xnn_datatype datatype,
                                                                 int32_t zero_point, const float* scale,
                                                                 size_t num_dims, size_t channel_dim,
                                                                 const size_t* dims, const void* data,
                                                                 uint32_t external_id, uint32_t flags,
                                                                 uint32_t* id_out);
enum xnn_status xnn_define_dynamically_quantized_tensor_value(xnn_subgraph_t subgraph, enum xnn_datatype datatype,
                                                              size_t num_dims, size_t num_nonbatch_dims,
                                                              const size_t* dims, uint32_t external_id,
                                                              uint32_t flags, uint32_t* id_out);

enum xnn_status xnn_define_unary(xnn_subgraph_t subgraph, enum xnn_unary_operator type,
                                 const union xnn_unary_params* params, uint32_t input_id, uint32_t output_id,
                                 uint32_t flags);
enum xnn_status xnn_define_binary(xnn_subgraph_t subgraph, enum xnn_binary_operator type,
                                  const struct xnn_binary_params* params, uint32_t input1_id, uint32_t input2_id,
                                  uint32_t output_id, uint32_t flags);
enum xnn_status xnn_define_convolution_2d(xnn_subgraph_t subgraph, uint32_t input_padding_top,
                                          uint32_t input_padding_right, uint32_t input_padding_bottom,
                                          uint32_t input_padding_left, uint32_t kernel_height, uint32_t kernel_width,
                                          uint32_t subsampling_height, uint32_t subsampling_width,
                                          uint32_t dilation_height, uint32_t dilation_width, uint32_t groups,
                                          size_t group_input_channels, size_t group_output_channels,
                                          float output_min, float output_max, uint32_t input_id, uint32_t filter_id,
                                          uint32_t bias_id, uint32_t output_id, uint32_t flags);
enum xnn_status xnn_define_depthwise_convolution_2d(xnn_subgraph_t subgraph, uint32_t input_padding_top,
                                                    uint32_t input_padding_right, uint32_t input_padding_bottom,
                                                    uint32_t input_padding_left, uint32_t kernel_height,
                                                    uint32_t kernel_width, uint32_t subsampling_height,
                                                    uint32_t subsampling_width, uint32_t dilation_height,
                                                    uint32_t dilation_width, uint32_t depth_multiplier,
                                                    size_t input_channels, float output_min, float output_max,
                                                    uint32_t input_id, uint32_t filter_id, uint32_t bias_id,
                                                    uint32_t output_id, uint32_t flags);
enum xnn_status xnn_define_deconvolution_2d(xnn_subgraph_t subgraph, uint32_t padding_top, uint32_t padding_right,
                                            uint32_t padding_bottom, uint32_t padding_left,
                                            uint32_t adjustment_height, uint32_t adjustment_width,
                                            uint32_t kernel_height, uint32_t kernel_width, uint32_t upsampling_height,
                                            uint32_t upsampling_width, uint32_t dilation_height,
                                            uint32_t dilation_width, uint32_t groups, size_t group_input_channels,
                                            size_t group_output_channels, float output_min, float output_max,
                                            uint32_t input_id, uint32_t filter_id, uint32_t bias_id,
                                            uint32_t output_id, uint32_t flags);
enum xnn_status xnn_define_fully_connected(xnn_subgraph_t subgraph, float output_min, float output_max,
                                           uint32_t input_id, uint32_t filter_id, uint32_t bias_id,
                                           uint32_t output_id, uint32_t flags);
enum xnn_status xnn_define_static_reshape(xnn_subgraph_t subgraph, size_t num_dims, const size_t* new_shape,
                                          uint32_t input_id, uint32_t output_id, uint32_t flags);
enum xnn_status xnn_define_batch_matrix_multiply(xnn_subgraph_t subgraph, uint32_t input1_id, uint32_t input2_id,
                                                 uint32_t output_id, uint32_t flags);

enum xnn_status xnn_create_weights_cache_with_size(size_t size, xnn_weights_cache_t* weights_cache_out);
enum xnn_status xnn_finalize_weights_cache(xnn_weights_cache_t weights_cache,
                                           enum xnn_weights_cache_finalization_kind finalization_kind);
enum xnn_status xnn_delete_weights_cache(xnn_weights_cache_t weights_cache);

enum xnn_status xnn_create_runtime_v4(xnn_subgraph_t subgraph, xnn_weights_cache_t weights_cache,
                                      xnn_workspace_t workspace, pthreadpool_t threadpool, uint32_t flags,
                                      xnn_runtime_t* runtime_out);
enum xnn_status xnn_reshape_runtime(xnn_runtime_t runtime);
enum xnn_status xnn_setup_runtime_v2(xnn_runtime_t runtime, size_t num_external_values,
                                     const struct xnn_external_value* external_values);
enum xnn_status xnn_invoke_runtime(xnn_runtime_t runtime);
enum xnn_status xnn_delete_runtime(xnn_runtime_t runtime);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif /* XNNPACK_H_ */
