package replicas

// What the codec's tests (and FuzzDecodeContent) need of it: the message
// format is written by ContentShare.Record and read by its subscription,
// and nothing else in tether encodes or decodes one.

// ContentBatch is one message: the records of Replica.
type ContentBatch struct {
	Replica string
	Records []ContentRecord
}

// EncodeContent appends b's message to dst.
func EncodeContent(dst []byte, b ContentBatch) []byte {
	dst = appendContentHeader(dst, b.Replica)
	for _, r := range b.Records {
		dst = appendContentRecord(dst, r.Instance, r.At, r.Chain)
	}
	return dst
}

// DecodeContent reads one message. A message that does not decode whole
// gives an error and no records: nothing of a corrupt message is applied.
func DecodeContent(msg []byte) (ContentBatch, error) {
	replica, rest, err := decodeContentHeader(msg)
	if err != nil {
		return ContentBatch{}, err
	}
	recs, err := decodeContentRecords(rest)
	if err != nil {
		return ContentBatch{}, err
	}
	return ContentBatch{Replica: replica, Records: recs}, nil
}
