// tokenizer.h: text to token ids and back, for `strata tokenize` and `strata generate`, and the
// documents of the input files `strata tokenize` reads.
//
// Three tokenizers behind one interface:
// - the byte tokenizer: ids 0..255 are the bytes themselves and id 256 is end-of-text, so its
//   vocabulary is 257 (a model trained on its tokens needs vocab_size >= 257); decoding drops
//   end-of-text ids;
// - SentencePiece models (`*.model`, as Llama 2 and many others ship), through Debian's
//   libsentencepiece; their end-of-text id is the model's </s> piece, when it has one, and
//   their prefix its <s> (as Hugging Face's LlamaTokenizer adds it), when it has one;
// - Hugging Face `tokenizer.json` files with a BPE model (hf_tokenizer.cpp): Llama 3's and
//   GPT-2's and Qwen2's byte-level BPE, and the byte-fallback BPE of Llama 2's and Mistral's
//   fast tokenizers. Supported: normalizers Prepend, Replace, NFC, NFD, NFKC, NFKD (ICU),
//   Sequence; pre-tokenizers Split,
//   ByteLevel, Metaspace, Digits, Sequence; decoders ByteLevel, Replace, ByteFallback, Fuse,
//   Strip, Metaspace, Sequence; post-processors TemplateProcessing, ByteLevel, Sequence; added
//   tokens (matched in the raw text, lstrip/rstrip honoured). Anything else is an Error naming
//   its place in the file. encode() is the library's encode(text, add_special_tokens=False);
//   prefix_ids()/suffix_ids() are what add_special_tokens=True puts around it (Llama's
//   begin-of-text); decode() is decode(ids, skip_special_tokens=True). End-of-text is
//   tokenizer_config.json's eos_token beside the file, else a token named <|end_of_text|>,
//   <|endoftext|>, </s> or <eos>.
//
// Input documents (the one choice to know before editing): a `.jsonl` file holds one JSON
// object per line, either a "text" string (one document) or a "prompt" and a "completion"
// string (the prompt-completion rows of Hugging Face TRL's SFT datasets): blank lines are
// skipped. Any other file is plain text, one document per file, unless it has lines made of a
// single "%" (the fortune database's format), which separate documents. Empty documents are
// dropped. `strata tokenize` writes the end-of-text id between consecutive documents (and after
// the last with --append-eos). A prompt is encoded on its own, then its completion, and only
// the completion's tokens and the end-of-text after it count as targets (loss masks,
// model/tokens.h); the tokenizer's prefix and the prompt do not. A conversation ("messages", a
// "prompt" and a "completion" that are lists of messages, or ShareGPT's "conversations" of
// "from" and "value" turns) is rendered by the model's chat template (ChatFormat) and encoded
// whole; only its replies count, unless ChatOptions says all.
#pragma once

#include "model/tokens.h"
#include "train/chat_template.h"

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<uint32_t> encode(std::string_view text) const = 0;
  // An id at or above vocab_size() is an Error naming it.
  virtual std::string decode(std::span<const uint32_t> ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual std::optional<uint32_t> eos_id() const = 0;  // end-of-text, if the vocabulary has one
  // The special tokens the tokenizer puts before and after a text it encodes for a model (a
  // Hugging Face post-processor's template: Llama's begin-of-text); none by default.
  virtual std::vector<uint32_t> prefix_ids() const { return {}; }
  virtual std::vector<uint32_t> suffix_ids() const { return {}; }
  virtual std::string name() const = 0;  // "byte", or the model's path
  // The text of a special token, which decode() leaves out (<|eot_id|>, </s>; the byte
  // tokenizer's end-of-text is "<eos>"); none for an ordinary token.
  virtual std::optional<std::string> special_piece(uint32_t) const { return std::nullopt; }
};

std::unique_ptr<Tokenizer> make_byte_tokenizer();
// Loads a SentencePiece model file; an Error names the file and why it could not be read.
std::unique_ptr<Tokenizer> load_sentencepiece_tokenizer(const std::filesystem::path& model);
// Loads a Hugging Face tokenizer.json (and tokenizer_config.json beside it, if there is one);
// an Error names the file, the place in it and what is wrong or unsupported.
std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::filesystem::path& file);
// A special token's text in a tokenizer_config.json ("eos_token", ...): a string or an added
// token's {"content": s}; none when the key is absent or null.
std::optional<std::string> tokenizer_config_token(const nlohmann::json& config,
                                                  std::string_view key);
// The special tokens transformers hands a chat template from tokenizer_config.json.
inline constexpr const char* kSpecialTokenKeys[] = {
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"};
// The tokenizer file a Hugging Face model directory ships: tokenizer.json (the fast tokenizer,
// as transformers prefers it), else tokenizer.model; none when it has neither.
std::optional<std::filesystem::path> model_tokenizer_file(const std::filesystem::path& dir);
// "byte"; a `.json` file (Hugging Face); a directory (a Hugging Face model's: its
// tokenizer.json, else its tokenizer.model); else the path of a SentencePiece model.
std::unique_ptr<Tokenizer> open_tokenizer(std::string_view spec);

// A conversation as read from its row, before its chat template renders it.
struct Conversation {
  nlohmann::ordered_json messages, tools;
  // The row's "chat_template_kwargs" (TRL passes them to apply_chat_template, which hands them
  // to the template: enable_thinking, ...): an object, empty where the row has none.
  nlohmann::ordered_json template_kwargs = nlohmann::ordered_json::object();
  size_t prompt_messages = 0;  // a prompt/completion row: how many messages are the prompt's
  std::string source;          // the file and line, named in errors
  int64_t line = 0;
  uint64_t bytes = 0;  // the row's size, what the batch counts before it is rendered
};

// One document: its text, or a prompt and its completion (`text`), of which only the completion
// is trained on, or a conversation rendered by a chat template.
struct Document {
  std::string prompt;  // empty: a plain document, every token of which counts
  std::string text;
  // A conversation: `text` is the template's rendering, encoded whole without the tokenizer's
  // prefix or suffix (the template writes its own markers), and `replies` the byte ranges of it
  // that count as targets (none: every token counts).
  bool rendered = false;
  std::vector<std::pair<uint64_t, uint64_t>> replies;
  // A conversation left for render_conversations (ChatOptions::defer), not rendered yet.
  std::shared_ptr<const Conversation> pending;
  bool operator==(const Document&) const = default;
};

// A model's chat template with the special tokens its tokenizer_config.json gives it to print
// (bos_token, eos_token, ...), run as transformers' apply_chat_template runs it.
struct ChatFormat {
  std::shared_ptr<const ChatTemplate> default_template;
  std::shared_ptr<const ChatTemplate> tool_template;  // a config's "tool_use" template, if any
  nlohmann::ordered_json tokens = nlohmann::ordered_json::object();
  std::string source;  // the file the template came from
  // apply_chat_template(messages, tools=tools (null: none), add_generation_prompt, tokenize=False,
  // **kwargs): `kwargs` (an object) are the template's further variables, over the special
  // tokens; `generation`: the byte ranges its {% generation %} blocks wrote
  // (ChatTemplate::render).
  std::string render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                     bool add_generation_prompt,
                     std::vector<std::pair<uint64_t, uint64_t>>* generation = nullptr,
                     const nlohmann::ordered_json& kwargs = nlohmann::ordered_json::object()) const;
  // The template rendering `tools` (the tool_use one where tools are given and it has one).
  const ChatTemplate& for_tools(const nlohmann::ordered_json& tools) const;
};

// The chat template for `tokenizer_spec` (open_tokenizer's argument): `template_path` when
// given (a .jinja file, a tokenizer_config.json, or a model directory), else the one beside the
// tokenizer (its directory's chat_template.jinja, else its tokenizer_config.json's
// "chat_template"); none when neither has one. The special tokens come from the tokenizer's
// tokenizer_config.json (else the template's), and each must encode as one token with
// `tokenizer` (a SentencePiece model reads "<s>" as text): an Error otherwise, naming it.
std::optional<ChatFormat> open_chat_format(const Tokenizer& tokenizer,
                                           std::string_view tokenizer_spec,
                                           const std::string& template_path = {});

// How .jsonl conversations ("messages" rows, or a "prompt" and a "completion" that are lists of
// messages) become documents.
struct ChatOptions {
  std::optional<ChatFormat> format;  // none: such rows are an Error saying what is missing
  std::string unavailable;  // why there is no format, where reading one failed (named then)
  bool all_tokens = false;  // every token counts, not the assistant's replies alone
  // Conversations are read and checked, but left `pending` for render_conversations, which
  // renders a batch of them on every core (tokenize_files does).
  bool defer = false;
};

// Renders the pending conversations of `documents` in parallel, in place. An Error names the
// first (in order) that could not be rendered, with its row.
void render_conversations(std::vector<Document>& documents, const ChatOptions& chat);

enum class DocumentFormat : uint8_t { text, jsonl };
// By extension: ".jsonl" is jsonl, anything else text.
DocumentFormat document_format_of(const std::filesystem::path& path);

// Receives each document in turn.
using DocumentFn = std::function<void(Document)>;
// Told, after a document, how many bytes of the text have been read.
using ConsumedFn = std::function<void(uint64_t)>;
// Each document of `text` (the contents of `source`) in order, one at a time.
void for_each_document(std::string_view text, DocumentFormat format, std::string_view source,
                       const DocumentFn& fn, const ConsumedFn& consumed = {},
                       const ChatOptions* chat = nullptr);
// Each document of the file at `path` in order (mapped, not read into memory whole).
void read_documents(const std::filesystem::path& path, const DocumentFn& fn,
                    const ChatOptions* chat = nullptr);

// The documents of `text` (the contents of `source`, named in errors: a .jsonl line that is not
// a JSON object with a "text" string, or a "prompt" and a "completion" string, is an Error
// naming the source and the line number).
std::vector<Document> split_documents(std::string_view text, DocumentFormat format,
                                      std::string_view source, const ChatOptions* chat = nullptr);
// Reads `path` and splits it by its format; a missing or unreadable file is an Error naming it.
std::vector<Document> read_documents(const std::filesystem::path& path);

// The token stream of `documents`: each one encoded between the tokenizer's prefix and suffix
// ids, end-of-text between consecutive ones (unless the suffix already ends with it) and, with
// `append_eos`, after the last. An Error when an end-of-text id is needed and the tokenizer has
// none.
// `after_others`: documents were written before these, so end-of-text separates the first of
// them from those too.
std::vector<uint32_t> tokenize_documents(const Tokenizer& tokenizer,
                                         const std::vector<std::string>& documents, bool append_eos,
                                         bool after_others = false);
// The same stream for documents that may have prompts, with a flag per token: 1 where the token
// counts as a target, 0 for a prompted document's prefix and prompt tokens. A rendered
// conversation is encoded whole, as apply_chat_template(tokenize=True) encodes it, and its reply
// tokens counted: where encoding each reply's text apart from the rest gives the same ids, those;
// otherwise the ids past the longest common prefix of the whole's with the encoding of the text
// before the reply, up to that of the text through it (TRL's rule for prompts). The end-of-text
// after a conversation is left out where its tokens already end with it, and does not count
// where it has replies (the template's own end marker does).
struct TokenStream {
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> counts;
  std::vector<uint64_t> starts;  // where each document's first token is (none for an empty one)
  bool prompted = false;         // some document had a prompt
  // prompt/completion documents whose prompt alone encodes otherwise than the start of the two
  // together (a token across the boundary): the prompt's count of tokens is masked all the same
  uint64_t straddling = 0;
};
TokenStream encode_documents(const Tokenizer& tokenizer, const std::vector<Document>& documents,
                             bool append_eos, bool after_others = false);

// What tokenize_files wrote.
struct TokenizedFiles {
  uint64_t documents = 0, bytes = 0, tokens = 0;
  uint64_t prompted = 0;       // documents with a prompt (a prompt/completion row, or a template's)
  uint64_t conversations = 0;  // documents rendered by the chat template
  uint64_t untemplated = 0;    // documents left out: no response template in them
  uint64_t counted = 0;        // tokens that count as targets (all of them without prompts)
  uint64_t straddling = 0;     // prompt/completion rows with a token across the boundary
  std::vector<std::filesystem::path> masks;    // beside `files`, where some document had a prompt
  std::vector<std::filesystem::path> removed;  // earlier runs' masks beside `files`, removed
  std::vector<std::filesystem::path> indexes;  // document indexes, one beside each of `files`
  TokenWidth width = TokenWidth::u16;          // uint32 for a vocabulary above 65,536
  std::vector<std::filesystem::path> files;
};

// A document is encoded whole: its text, its words in flight, its ids and the stream's copy of
// them take about this many bytes a byte (measured: 7 with Llama 3's layout, 8 with the byte
// tokenizer, 15 where the whole text is BPE's one word).
inline constexpr uint64_t kDocumentBytesPerByte = 16;

struct TokenizeOptions {
  uint64_t shard_tokens = 0;  // llm.c shards of at most this many tokens (0: one file)
  bool append_eos = false;    // end-of-text after the last document too
  // Non-empty: a plain document is a prompt up to and including the first occurrence of this
  // text and a completion after it, as TRL's DataCollatorForCompletionOnlyLM splits them
  // ("### Response:"); one that does not hold it is left out, as that collator ignores it.
  std::string response_template;
  uint64_t batch_bytes = 16ull << 20;  // documents read, encoded and written at a time
  uint64_t memory_bytes = 0;           // what a document may take (0: memory available now)
  const ChatOptions* chat = nullptr;   // conversations in .jsonl rows
};

// `strata tokenize`: the documents of `inputs`, in order, as one token stream (the rules of
// tokenize_documents) into llm.c files at `output` (LlmcTokenWriter: one file, or shards of at
// most `shard_tokens`), and where any document has a prompt, a loss mask beside each file
// (LossMaskWriter); where none has, a mask left beside an output file by an earlier run is
// removed. A document index beside each file (DocumentIndexWriter) says where each document
// starts: its first token (the prefix's, where the tokenizer has one); the end-of-text after a
// document belongs to it. Memory stays bounded: documents are read `batch_bytes` of text at a time,
// encoded in parallel and written before the next batch is read, and each input file is mapped, not
// copied. The same tokens for any batch size. An Error when the inputs hold no document
// (nothing is written), and when one document is too large to encode whole in `memory_bytes`,
// at kDocumentBytesPerByte (refused before it is encoded, not killed by the kernel halfway).
TokenizedFiles tokenize_files(const Tokenizer& tokenizer,
                              const std::vector<std::filesystem::path>& inputs,
                              const std::filesystem::path& output,
                              const TokenizeOptions& options = {});

}  // namespace strata
