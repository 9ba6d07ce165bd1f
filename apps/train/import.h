#pragma once
// Starting a model from someone else's weights: a safetensors file in a published layout, its
// tensors mapped onto the model's variables by name, checked, converted and transposed.
#include <filesystem>
#include <string>
#include <string_view>

#include "baton/graph.h"
#include "baton/graph/safetensors.h"

namespace baton::models {

/// The layouts init_from() reads, one per baton-train --model:
///  - "llama": transformers' LlamaForCausalLM (models::llama uses its names). Every
///    `*_proj.weight` and `lm_head.weight` is a torch Linear weight [out, in], transposed to
///    baton's [in, out]; the token table and the norms are taken as they are. A tied model's
///    file may hold no lm_head.weight (transformers drops the shared tensor), or one equal to
///    the token table.
///  - "gpt2": transformers' GPT-2 (models::gpt2 uses its names; with or without the
///    "transformer." prefix). Its Conv1D weights are [in, out] already, c_attn stays fused (the
///    model splits it), the head is tied (lm_head.weight, if there, must be wte.weight), and
///    the attention masks some files carry (h.N.attn.bias, h.N.attn.masked_bias) are skipped.
///  - "gpt", "mlp": baton's own names and layout (what baton writes), nothing transposed.
/// Under tensor parallelism a variable "NAME.tp<k>" is shard k of the file's NAME, cut along
/// the one axis where the shard is narrower (rows or columns, as the model splits it).
///
/// Each tensor is converted to its variable's dtype (F16, BF16, F32 and F64 files into f32 or
/// f64 weights: widening is exact; narrowing rounds to nearest, as torch's load_state_dict
/// copies). Throws std::invalid_argument "FILE: ..." naming the tensor for a variable the file
/// lacks, a tensor no variable takes, a shape that does not match (both shapes, in the file's
/// layout) or a dtype that is not floating; the safetensors reader's errors for a bad file.
void init_from(const std::filesystem::path& file, std::string_view layout, ParameterStore& params);

/// The same, from a file already read (`file` names it in errors).
void init_from(const safetensors::Contents& contents, const std::filesystem::path& file,
               std::string_view layout, ParameterStore& params);

}  // namespace baton::models
