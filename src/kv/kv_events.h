// Changes to the prefix cache's index, in the order they happen, for KV-aware routers: a block's hash
// entering the index (BlockStored), leaving it (BlockRemoved), or the whole index emptied
// (AllBlocksCleared). The server publishes them in vLLM's event schema (server/kv_events.h).
#pragma once
#include <cstdint>
#include <optional>
#include <vector>

namespace serval {

struct KvEvent {
  enum class Kind { BlockStored, BlockRemoved, AllBlocksCleared };
  Kind kind = Kind::BlockStored;
  // BlockStored: consecutive full blocks of one sequence, each the chain hash of its parent and its
  // tokens (KvManager::block_hash). BlockRemoved: hashes in the order they left.
  std::vector<uint64_t> block_hashes;
  std::optional<uint64_t> parent_hash;  // BlockStored: hash of the block before the first; none at the start
  std::vector<int32_t> token_ids;       // BlockStored: block_size tokens per block
};

}  // namespace serval
