// apply_context_parallel (context_parallel.h): installs cp::attention in the
// model's attention modules and sets the positions of this rank's chunks.
#include "distributed/parallel/cp/context_parallel.h"

#include <string>
#include <vector>

#include "distributed/parallel/cp/load_balance.h"
#include "nn/transformer.h"

namespace ember::distributed::cp {

void apply_context_parallel(nn::Module& module, const std::shared_ptr<ProcessGroup>& pg,
                            const ContextParallelOptions& o) {
  if (pg == nullptr || pg->size() == 1) return;
  const int cp = pg->size(), rank = pg->rank();
  const std::string what = "context parallelism (cp " + std::to_string(cp) + ", " + exchange_name(o.exchange) + ")";
  EMBER_CHECK(o.seq > 0, what, ": the sequence length must be given (ContextParallelOptions::seq)");
  chunk_length(o.seq, cp);  // 2 cp must divide seq: its own named error
  const std::vector<int64_t> pos = positions(o.seq, cp, rank);
  const Tensor positions_t = Tensor::from_vector(std::vector<double>(pos.begin(), pos.end()),
                                                 {static_cast<int64_t>(pos.size())}, DType::Int64);
  const Exchange ex = o.exchange;
  nn::AttentionFn fn = [pg, ex](const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double dropout_p,
                                Generator*) {
    EMBER_CHECK(dropout_p == 0, "context-parallel attention: attention dropout ", dropout_p,
                " is not supported under context parallelism");
    return attention(q, k, v, causal, ex, pg);
  };
  int routed = 0;
  for (auto& [path, m] : module.named_modules()) {
    const std::string where = path.empty() ? std::string("the root") : "'" + path + "'";
    if (auto* a = dynamic_cast<nn::MultiheadAttention*>(m)) {
      EMBER_CHECK(a->dropout == 0, what, ": attention ", where, " has dropout ", a->dropout,
                  "; context parallelism needs it 0");
      EMBER_CHECK(ex != Exchange::AllToAll || a->num_heads % cp == 0, what, ": attention ", where, " has ",
                  a->num_heads, " heads, which cp ", cp, " does not divide (alltoall splits heads)");
      a->attention = fn;
      ++routed;
    } else if (auto* g = dynamic_cast<nn::GroupedQueryAttention*>(m)) {
      EMBER_CHECK(g->options.dropout == 0, what, ": attention ", where, " has dropout ", g->options.dropout,
                  "; context parallelism needs it 0");
      EMBER_CHECK(ex != Exchange::AllToAll || g->n_head % cp == 0, what, ": attention ", where, " has ", g->n_head,
                  " heads, which cp ", cp, " does not divide (alltoall splits heads)");
      g->attention = fn;
      g->positions = positions_t;
      ++routed;
    } else if (m->type_name().find("Attention") != std::string::npos) {
      EMBER_CHECK(false, what, ": module ", where, " of type ", m->type_name(),
                  " is an attention the transform cannot route through the context-parallel path "
                  "(MultiheadAttention and GroupedQueryAttention can)");
    }
    if (auto* gpt = dynamic_cast<nn::GPT*>(m))
      EMBER_CHECK(gpt->options.block_size >= o.seq, what, ": sequence ", o.seq, " exceeds the GPT's block_size ",
                  gpt->options.block_size);
    if (auto* sp = dynamic_cast<nn::SequencePositions*>(m)) {
      sp->positions = positions_t;
      ++routed;  // a pipeline's embedding stage may hold no attention
    }
  }
  EMBER_CHECK(routed > 0, what, ": the module has no attention to route");
}

}  // namespace ember::distributed::cp
