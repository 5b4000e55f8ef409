package extproc

// OnRead has s tell read the name of every header it reads.
func OnRead(s *Server, read func(name string)) { s.read = read }
